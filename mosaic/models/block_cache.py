"""The block step of block-diffusion models (LLaDA2.x): exact block K/V cache by construction.

Attention is causal across blocks of `block` canvas columns and bidirectional inside one, so a
finished block's K and V depend only on tokens that never change again: they are computed once
and kept in the request's store (memory/kv_store.py, [B, L, kv_dim] per layer), and a step runs
only the rows [a, hi) whose K/V are not final yet:

  a .. lo   blocks finished since the last step (their final tokens: K/V computed once, stored)
  lo .. hi  the block being denoised (recomputed at every step, as the published code does)

The first step of a request has a = 0 (the whole prompt, its left padding included). Query
block j attends the store's keys [pad, end of block j) of its own sequence (graph/block_ops.py).
Every sequence of a batch lays its blocks on the same columns (runtime/block_canvas.py): its
left padding is a whole number of blocks, its positions count from its first real token. K is
stored after RoPE (RoPE is per position, so the stored key is the key the published forward
recomputes). Shapes depend on (B, hi - a, L, block), never on which block runs.

A batch of B > 1 sequences runs as a batched step (models/batched_attention.py) when its
attention is not chunked: the projections once over all B x n rows (one read of the attention
weights per step, not one per sequence), the fresh K/V into the store by one indexed copy, and
one attention call over every (sequence, block) entry: block j of sequence b against the keys
[pad_b, a + (j + 1) x block) of its store row (kernels/varlen.py; on CUDA flash varlen, whose
rounding differs from one call per block: Generation.lossy says so; the loop, the per-block
calls, on the CPU and in batch-invariant mode). Several requests' block steps of n rows stack the
same way (continuous batching, engine/batching.py) when their stores live in one paged pool
(memory/kv_pool.py): `stacked_diffusion_step`, every request at its own block position."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..graph.shard import chunk_bounds
from ..kernels import varlen as VL
from ..kernels.host_ints import ints_on
from .batched_attention import BatchIndex, batched_attention
from .kv_cache import _store_layer
from .layers import _heads, _lin, _qk, reduce_tp, run_layers, tail
from .stacked_cache import Member, StackedBlocks
from .step import Step


@dataclass(frozen=True)
class BlockCacheStep:
    """Which rows a block step runs: canvas columns [a, hi) (a multiple of `block` each) of
    sequences of `length` columns; store: the request's KVStore (None while planning);
    resident_bytes: the device bytes the store holds (admission and chunking charge them);
    index: a batch's (sequence, block) attention entries in the store (block_step sets it, B > 1)."""
    a: int
    hi: int
    block: int
    length: int
    store: object | None = None
    resident_bytes: int = 0
    index: BatchIndex | None = None

    def key(self) -> tuple:
        """What a template depends on besides the step's own shape (and a batch's attention kernel)."""
        return ("blocks", self.block, self.length) + (() if self.index is None else (self.index.kernel,))

    def where(self) -> tuple:
        """The canvas columns this step runs (a captured step's addresses depend on them)."""
        return ("blocks", self.a, self.hi) + (() if self.index is None else self.index.fixed())

    def shared_kv(self, ctx, layer: int, kv_dim: int):
        """(K, V) [B*L, kv_dim]: the store's layer, its sequences one after another."""
        K, V = _store_layer(ctx, self, layer, self.index.write_rows.shape[0] // (self.hi - self.a), kv_dim)
        return K.reshape(-1, kv_dim), V.reshape(-1, kv_dim)

    def release_layer(self, ctx, layer: int) -> None:
        store = self.store
        ctx.custom("kv_release", lambda: store.release(layer, True))

    def graph_inputs(self) -> dict:
        return {} if self.index is None else self.index.tensors()

    def with_graph_inputs(self, t: dict) -> BlockCacheStep:
        return self if self.index is None else dataclasses.replace(self, index=self.index.with_tensors(t))

    @property
    def program(self):
        """The step program of this kind of step (models/kv_cache.program_for asks)."""
        return block_program


def block_step(ids: torch.Tensor, pads: tuple[int, ...], spec: BlockCacheStep, kernel: str | None = None,
               **fields) -> Step:
    """The Step of a block step: ids [B, L] (the whole canvas) sliced to [a, hi), positions
    counted from each sequence's first real column (pads[b], a multiple of the block). kernel:
    with B > 1, the batched attention's (kernels.varlen_kernel); None runs one call per block."""
    B, L = ids.shape
    cols = torch.arange(spec.a, spec.hi, device=ids.device)
    pad = ints_on(pads, ids.device)[:, None]
    positions = (cols[None, :] - pad).clamp_(min=0)                      # pad rows: never read
    if B > 1 and kernel is not None:
        spec = dataclasses.replace(spec, index=block_index(spec, pads, ids.device, kernel))
    return Step(ids[:, spec.a:spec.hi], positions, pads=tuple(pads) if any(pads) else None, cache=spec, **fields)


def block_index(spec: BlockCacheStep, pads, device, kernel: str) -> BatchIndex:
    """The batched step's entries: per sequence b and block j of its rows [a, hi), the block's
    query rows against the store row's keys [pad_b, a + (j + 1) x block) (none for a block that
    lies in the padding: its rows come out zero, as the per-block path writes them), and the
    store row each fresh K/V row goes to."""
    a, n, bl, L = spec.a, spec.hi - spec.a, spec.block, spec.length
    firsts, counts = [], []
    for b, p in enumerate(pads):
        for j in range(n // bl):
            firsts.append(b * L + p)
            counts.append(max(0, a + (j + 1) * bl - p))
    ent = VL.entries([bl] * len(firsts), firsts, counts, device)
    rows = ints_on([b * L + a + i for b in range(len(pads)) for i in range(n)], device)
    return BatchIndex(ent, rows, kernel)


@dataclass(frozen=True)
class StackedDiffusion(StackedBlocks):
    """Several requests' block-diffusion steps as one (stacked_diffusion_step): StackedBlocks's
    pooled protocol (shared_kv, graph inputs: every row offset is an input, so one graph serves
    every round of a batch bucket) with block-causal entries and this module's program."""
    block: int = 0

    def key(self) -> tuple:
        return ("blocks-pool", self.block, self.n, self.index.kernel, self.index.entries.max_k)

    @property
    def program(self):
        return block_program


def stacked_diffusion_step(cfg, parts, block: int, kernel: str, pad_to: int | None = None,
                           max_k: int | None = None, **fields) -> Step:
    """One step over several requests' block steps: parts = [(ids [B_i, W_i] the request's block
    canvas, pads_i (each row's left padding, whole blocks), a_i, hi_i, store_i)] with one n = hi_i
    - a_i and every store in one paged pool. Each sequence's entries are its own request's (block
    j against its keys [pad, a_i + (j + 1) x block) where its store lies in the pool), its fresh
    K/V go to its own rows, its positions count from its first real column. pad_to: sequences of
    the step (dummies beyond the real ones read and write only the pool's scratch rows); max_k:
    the bound on keys per entry (a captured step's bucket); kernel: kernels.varlen_kernel's.
    fields: rows (flat over the stacked B x n rows), reducer. Raises ValueError without a
    common pool or with unequal n."""
    n = parts[0][3] - parts[0][2]
    stores = {id(p[4]): p[4] for p in parts}.values()
    pool = getattr(next(iter(stores)), "pool", None)
    if pool is None or any(getattr(s, "pool", None) is not pool for s in stores) or \
            any(hi - a != n for _, _, a, hi, _ in parts):
        raise ValueError("stacked block-diffusion steps need stores in one paged pool and one row count")
    ids, pos, members, firsts, counts, rows = [], [], [], [], [], []
    for ids_i, pads_i, a, hi, store in parts:
        B_i, W_i = ids_i.shape
        ids.append(ids_i[:, a:hi])
        cols = torch.arange(a, hi, device=ids_i.device)
        pos.append((cols[None, :] - ints_on(pads_i, ids_i.device)[:, None]).clamp_(min=0))
        for b in range(B_i):
            start = store.first_row + b * W_i
            members.append(Member(store, b, a, W_i))
            for j in range(n // block):
                firsts.append(start + pads_i[b])
                counts.append(max(0, a + (j + 1) * block - pads_i[b]))
            rows += range(start + a, start + hi)
    dev = ids[0].device
    dummies = max(0, (pad_to or 0) - len(members))
    scratch = pool.scratch_rows(n) if dummies else None
    if scratch is None:          # no dummies, or under a budget no free pages hold them (memory/kv_pool.py)
        dummies = 0
    if dummies:
        for _ in range(dummies):
            firsts += [scratch] * (n // block)
            counts += [(j + 1) * block for j in range(n // block)]
            rows += range(scratch, scratch + n)
        ids.append(ids[-1][-1:].expand(dummies, n))
        pos.append(torch.arange(n, device=dev).expand(dummies, n))
    ent = VL.entries([block] * len(firsts), firsts, counts, dev, max_k)
    index = BatchIndex(ent, ints_on(rows, dev), kernel)
    spec = StackedDiffusion(tuple(members), n, max(sum(s.layout.device_bytes for s in stores),
                                                             pool.held_bytes), pool=pool, index=index,
                            block=block)
    return Step(torch.cat(ids), torch.cat(pos), cache=spec, **fields)


def block_program(ctx, model, step: Step):
    """embed -> per layer (block-causal attention over the store, FFN or MoE) -> tail over the
    masked rows of the B x (hi - a) rows that run."""
    ctx.set_phase("embed")
    x = ctx.embed("x", step.ids.reshape(-1), model.embed, scale=model.extra.get("embed_scale"))  # [B*n, d]
    run_layers(ctx, model, x, step, _block_attention)
    return tail(ctx, model, x, x, step)


def block_bounds(n: int, block: int, num_chunks: int) -> list[tuple[int, int]]:
    """Query chunks of whole blocks (the first ones largest, as the recording expects)."""
    return [(s * block, e * block) for s, e in chunk_bounds(n // block, num_chunks)]


def _block_attention(ctx, model, lw, x, step: Step, layer: int):
    cfg = model.cfg
    spec = step.cache
    B, n = step.ids.shape
    ctx.set_phase("attn")
    if spec.index is not None and (step.chunks.attn == 1 or not isinstance(spec, BlockCacheStep)):
        batched_attention(ctx, model, lw, x, step, layer)   # a stacked step never chunks its few rows
        return
    a, bl = spec.a, spec.block
    K, V = _store_layer(ctx, spec, layer, B, cfg.kv_dim)                  # [B, L, kv_dim] each
    bounds = block_bounds(n, bl, step.chunks.attn)
    for b in range(B):
        xb = x[b * n:(b + 1) * n]                                           # [n, d]
        pos = step.positions[b]
        pad = step.pads[b] if step.pads else 0
        k, v = K[b, a:a + n], V[b, a:a + n]                                 # the rows this step computes
        for s, e in ctx.loop(bounds):
            h = ctx.rmsnorm("h_kv", xb[s:e], lw["attn_norm"], cfg.rms_eps)
            _lin(ctx, model, "k", h, lw, "k", out=k[s:e])
            _lin(ctx, model, "v", h, lw, "v", out=v[s:e])
            _qk(ctx, model, k[s:e], lw.get("k_norm"), cfg.num_kv_heads, pos[s:e])
        kh = _heads(K[b], cfg.num_kv_heads, cfg.head_dim)                  # [L, Hkv, hd]
        vh = _heads(V[b], cfg.num_kv_heads, cfg.head_dim)
        for s, e in ctx.loop(bounds):
            h = ctx.rmsnorm("h_q", xb[s:e], lw["attn_norm"], cfg.rms_eps)
            q = _lin(ctx, model, "q", h, lw, "q")
            qh = _qk(ctx, model, q, lw.get("q_norm"), cfg.num_heads, pos[s:e])
            o = ctx.attention_blocks("attn_o", qh, kh, vh, bl, a + s, pad)  # [n_c, q_dim]
            y = _lin(ctx, model, "o_proj", o, lw, "o")
            ctx.add_(xb[s:e], reduce_tp(ctx, model, y))
    store = spec.store
    ctx.custom("kv_release", lambda: store.release(layer, True))
