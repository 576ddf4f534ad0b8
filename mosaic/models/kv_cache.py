"""Block-cache steps (Fast-dLLM's prefix and dual caches) as two new kinds of step program.

  fill   the whole sequence runs, exactly as step_program, except that each layer's K and V
         (after RoPE) are written into the request's store instead of transient buffers
  block  only the rows [lo, hi) of the canvas run (prefix cache: the block and everything right
         of it; dual cache: the block). Their fresh K/V overwrite rows [lo, hi) of the store and
         the queries attend over the store's rows [pad, L): cached prefix, fresh rows, cached
         suffix, in sequence order, as the published code concatenates (prefix) or replaces in
         place (dual)

Caching K after RoPE is exact: the published code caches K before RoPE and rotates the whole key
range again at every step, but RoPE is elementwise per position, so the same key at the same
position rotates to the same bits. The store is duck-typed (memory/kv_store.py): `acquire(i)`
-> (K, V) [B, L, kv_dim] device views of layer i, `release(i, wrote)` after the layer's
attention. Semantics and sources: docs/FAST_DECODING.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch

from ..graph.shard import chunk_bounds
from ..kernels.reference import ROW_TILE
from .batched_attention import BatchIndex, batch_index, batched_attention, varlen_kernel
from .fusion import fused_of, one_pass_norms
from .layers import _heads, _lin, _qk, _qk_norm, reduce_tp, run_layers, step_program, tail
from .step import Step, make_step

MODES = ("fill", "block")
# a one-chunk block step's fast path (_block_attention: per-step RoPE tables, one norm, q and k in
# one launch, the residual added in the FFN's norm); False runs the per-chunk path, the same bits
# (tests/gpu/test_fused_gpu.py compares the two)
BLOCK_PATH = True


@dataclass(frozen=True)
class CacheStep:
    """What kind of cached step runs and against which store.

    mode: fill | block; lo, hi: the canvas rows a block step runs (fill: 0, length); length: L,
    keys per sequence; store: the request's KVStore (None while planning); resident_bytes: the
    device bytes the store holds while the step runs (admission and chunking charge them);
    index: where a block step's B > 1 sequences lie in the store (models/batched_attention.py;
    set by cached_step)."""
    mode: str
    lo: int
    hi: int
    length: int
    store: object | None = None
    resident_bytes: int = 0
    index: BatchIndex | None = None

    def key(self) -> tuple:
        """What a template depends on besides the step's own shape: the key length (and a
        batched step's attention kernel)."""
        return ("kv", self.mode, self.length) + (() if self.index is None else (self.index.kernel,))

    def where(self) -> tuple:
        """The store rows this step writes (a captured step's addresses depend on them)."""
        return (self.mode, self.lo, self.hi) + (() if self.index is None else self.index.fixed())

    def sequence_kv(self, ctx, layer: int, batch: int, kv_dim: int) -> list[tuple]:
        """Per sequence b: (K_b, V_b [L, kv_dim], lo_b): the store's device views of one layer
        (meta tensors when recording: the store lives outside the plan) and the row this step's
        block starts at."""
        K, V = _store_layer(ctx, self, layer, batch, kv_dim)
        lo = self.lo if self.mode == "block" else 0
        return [(K[b], V[b], lo) for b in range(batch)]

    def release_layer(self, ctx, layer: int) -> None:
        store = self.store
        ctx.custom("kv_release", lambda: store.release(layer, self.mode == "fill"))

    def shared_kv(self, ctx, layer: int, kv_dim: int):
        """(K, V) [B*L, kv_dim]: the store's layer, its sequences one after another (the buffer a
        batched block step's index points into)."""
        K, V = _store_layer(ctx, self, layer, self.index.entries.num_entries, kv_dim)
        return K.reshape(-1, kv_dim), V.reshape(-1, kv_dim)

    def graph_inputs(self) -> dict:
        """The tensors a captured step reads that change between replays of one graph."""
        return {} if self.index is None else self.index.tensors()

    def with_graph_inputs(self, t: dict) -> CacheStep:
        return self if self.index is None else dataclasses.replace(self, index=self.index.with_tensors(t))


def cached_step(cfg, ids: torch.Tensor, valid: torch.Tensor | None, spec: CacheStep, batch_invariant: bool = False,
                varlen: str = "auto", **fields) -> Step:
    """The Step of a fill (ids [B, L]) or a block step (ids [B, L] sliced to [lo, hi), positions
    as the full sequence's, left-padded keys still masked). fields: rows, reducer, dtype, ...;
    batch_invariant and varlen: the engine's mode and varlen_kernel setting (a batched block
    step's attention kernel, kernels.varlen_kernel; InputError where it cannot run)."""
    full = make_step(cfg, ids, valid, cache=spec, **fields)
    if spec.mode == "fill":
        return full
    lo, hi = spec.lo, spec.hi
    B, L = ids.shape
    kernel = varlen_kernel(cfg, ids.device, fields.get("dtype") or torch.float32, batch_invariant, varlen)
    # the batched block step's index (models/batched_attention.py); alone too for the Triton varlen
    # kernel (batch-invariant mode on CUDA: a request's block steps run the kernel its batched ones run)
    if B > 1 or kernel == "triton":
        pads = full.pads or (0,) * B
        spec = dataclasses.replace(spec, index=batch_index([b * L for b in range(B)], [L] * B, pads, [lo] * B,
                                                           hi - lo, ids.device, kernel=kernel))
    # block rows are right of every prompt, so no query row is padding (zero_pad_rows is moot)
    return full.with_(ids=ids[:, lo:hi], positions=full.positions[:, lo:hi], zero_pad_rows=False, cache=spec)


def program_for(step: Step):
    """The step program that runs `step`: the cached one when it carries a CacheStep, the
    block-diffusion one (models/block_cache.py) when it carries a BlockCacheStep."""
    if step.cache is None:
        return step_program
    return step.cache.program if hasattr(step.cache, "program") else cached_program


def cached_program(ctx, model, step: Step):
    """A fill or block step: embed -> per layer (cached attention, FFN or MoE) -> tail; returns
    the tail's per-slot outputs (rows index the B x (hi - lo) rows that run). With step.offload
    the layer weights stream from host memory through planned staging slots, as in
    step_program (its K/V never do: the store has its own tier)."""
    ctx.set_phase("embed")
    x = ctx.embed("x", step.ids.reshape(-1), model.embed, scale=model.extra.get("embed_scale"))  # [B*n, d]
    tables = None
    if BLOCK_PATH and step.cache.mode == "block" and step.chunks.attn == 1 and step.ids.shape[0] == 1 \
            and x.shape[0] <= ROW_TILE:
        # a block step's rows are few: its RoPE cos / sin once for every layer (graph/rope_ops.py)
        tables = ctx.rope_tables(step.positions.reshape(-1), model.inv_freq)
    with ctx.one_pass_norms(one_pass_norms(model, step)):   # fused_projections: all (labelled)
        run_layers(ctx, model, x, step, partial(_cached_attention, tables=tables))
        return tail(ctx, model, x, x, step)


def _store_layer(ctx, spec: CacheStep, layer: int, batch: int, kv_dim: int):
    """(K, V) [B, L, kv_dim] of one layer: the store's device views, or meta tensors when
    recording (the store lives outside the plan)."""
    held = {}
    store = spec.store
    ctx.custom("kv_acquire", lambda: held.update(kv=store.acquire(layer)))
    if ctx.compute:
        return held["kv"]
    shape = (batch, spec.length, kv_dim)
    return (torch.empty(shape, dtype=ctx.dtype, device="meta"),
            torch.empty(shape, dtype=ctx.dtype, device="meta"))


def _cached_attention(ctx, model, lw, x, step: Step, layer: int, tables=None):
    """The layer's attention over the store; returns the residual still to add to x (the FFN's
    norm adds it in its own pass) or None when it was added."""
    spec = step.cache
    B, n = step.ids.shape
    ctx.set_phase("attn")
    # with the Triton varlen kernel every block step runs batched (alone included: the same kernel);
    # its query rows are never chunked (B x block rows: attention is not a block step's peak)
    if spec.index is not None and (step.chunks.attn == 1 or spec.index.kernel == "triton"):
        batched_attention(ctx, model, lw, x, step, layer)
        return None
    seqs = spec.sequence_kv(ctx, layer, B, model.cfg.kv_dim)           # (K_b, V_b, lo_b) per sequence
    pending = None
    if tables is not None:                                              # one sequence, one chunk
        pending = _block_attention(ctx, model, lw, x, step, seqs[0], tables, layer)
    else:
        for b in range(B):
            _sequence_attention(ctx, model, lw, x, step, seqs[b], b)
    spec.release_layer(ctx, layer)
    return pending


def _block_attention(ctx, model, lw, x, step: Step, seq, tables, layer: int):
    """One sequence's block rows in one chunk: one norm for q, k and v (the chunked path norms
    the rows twice), k and v projected straight into the store, q and k rotated in one launch
    with the step's tables; returns o_proj's rows [n, d] (the residual, added by the FFN's norm)."""
    cfg = model.cfg
    n = x.shape[0]
    Kb, Vb, lo = seq
    pad = step.pads[0] if step.pads else 0
    h = ctx.rmsnorm("h_attn", x, lw["attn_norm"], cfg.rms_eps)          # [n, d]
    k, v = Kb[lo:lo + n], Vb[lo:lo + n]                                 # this step's own rows
    fused = fused_of(model, layer, step)
    if "qkv" in fused and not cfg.qk_norm:   # opt-in (fused_projections: all): one GEMM, one kernel after it
        qkv = ctx.linear("qkv", h, fused["qkv"], fused.get("qkv_bias"))   # [n, q_dim + 2 kv_dim]
        ctx.qkv_rope_store(qkv, k, v, tables, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_fp32)
        qh = _heads(qkv[:, :cfg.q_dim], cfg.num_heads, cfg.head_dim)
    else:
        _lin(ctx, model, "k", h, lw, "k", out=k)
        _lin(ctx, model, "v", h, lw, "v", out=v)
        q = _lin(ctx, model, "q", h, lw, "q")                          # [n, q_dim]
        qh = _qk_norm(ctx, model, q, lw.get("q_norm"), cfg.num_heads)
        ctx.rope_pair_(qh, _qk_norm(ctx, model, k, lw.get("k_norm"), cfg.num_kv_heads), tables, cfg.rope_fp32)
    kh = _heads(Kb[pad:], cfg.num_kv_heads, cfg.head_dim)              # [L - pad, Hkv, hd]
    vh = _heads(Vb[pad:], cfg.num_kv_heads, cfg.head_dim)
    o = ctx.attention("attn_o", qh, kh, vh, own=True)                  # [n, q_dim], SDPA's own
    return reduce_tp(ctx, model, _lin(ctx, model, "o_proj", o, lw, "o"))


def _sequence_attention(ctx, model, lw, x, step: Step, seq, b: int):
    """One sequence's rows: its projections, its K/V into the store, attention, o_proj."""
    cfg = model.cfg
    B, n = step.ids.shape
    Kb, Vb, lo = seq
    xb = x[b * n:(b + 1) * n]                                           # [n, d]
    pos = step.positions[b]
    pad = step.pads[b] if step.pads else 0
    k, v = Kb[lo:lo + n], Vb[lo:lo + n]                                 # this step's own rows
    bounds = chunk_bounds(n, step.chunks.attn)
    for s, e in ctx.loop(bounds):
        h = ctx.rmsnorm("h_kv", xb[s:e], lw["attn_norm"], cfg.rms_eps)
        _lin(ctx, model, "k", h, lw, "k", out=k[s:e])
        _lin(ctx, model, "v", h, lw, "v", out=v[s:e])
        _qk(ctx, model, k[s:e], lw.get("k_norm"), cfg.num_kv_heads, pos[s:e])
    kh = _heads(Kb[pad:], cfg.num_kv_heads, cfg.head_dim)              # [L - pad, Hkv, hd]
    vh = _heads(Vb[pad:], cfg.num_kv_heads, cfg.head_dim)
    for s, e in ctx.loop(bounds):
        h = ctx.rmsnorm("h_q", xb[s:e], lw["attn_norm"], cfg.rms_eps)
        q = _lin(ctx, model, "q", h, lw, "q")
        qh = _qk(ctx, model, q, lw.get("q_norm"), cfg.num_heads, pos[s:e])
        o = ctx.attention("attn_o", qh, kh, vh)                        # [n_c, q_dim]
        if step.zero_pad_rows and lo + s < pad:
            ctx.custom("pad_rows", lambda o=o, r=min(pad - lo, e) - s: o[:r].zero_(), o)
        y = _lin(ctx, model, "o_proj", o, lw, "o")
        ctx.add_(xb[s:e], reduce_tp(ctx, model, y))
