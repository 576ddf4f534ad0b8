"""The attention block of a batched block step: every sequence's block rows at once.

The q, k, v and o projections run as one GEMM each over the B x n rows (one read of each weight
per step, not one per sequence: a dual-cache block step of 16 x 32 rows read LLaDA-8B's attention
weights 16 times, 94.6 ms vs 9.9 ms at batch 1). The fresh K/V go into their stores' rows by one
indexed copy (ctx.kv_scatter) and attention runs over every sequence in one call
(ctx.attention_varlen: each sequence's own block of query rows against its own keys [pad, L),
where they lie in the K/V buffer the sequences share: one request's store, or the engine's paged
pool, memory/kv_pool.py). A spec whose sequences do not share one buffer falls back to one
attention per sequence (the loop this replaced: 512 SDPA calls per step at batch 16).

The spec (models/kv_cache.CacheStep or models/stacked_cache.StackedBlocks) provides:
  index                  a BatchIndex (below), built with the step
  shared_kv(ctx, layer)  (K, V) [R, kv_dim] of the shared buffer, or None
  sequence_kv(ctx, layer, B, kv_dim), release_layer(ctx, layer): the per-sequence protocol"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .. import kernels
from ..kernels import varlen as VL
from ..kernels.host_ints import ints_on
from .layers import _heads, _lin, _qk, reduce_tp
from .step import Step


@dataclass(frozen=True)
class BatchIndex:
    """Where a batched block step's sequences lie in their shared K/V buffer: entries (one per
    sequence: its n query rows against its keys), write_rows [B*n] int64 (the buffer row each
    fresh K/V row goes to) and the attention kernel (kernels.varlen_kernel). Device tensors: a
    captured step rewrites them before each replay; the loop kernel also reads the host offsets,
    so a captured loop is keyed by them (`fixed`)."""
    entries: VL.Entries
    write_rows: torch.Tensor
    kernel: str = "loop"

    def fixed(self) -> tuple:
        """What a captured step bakes in besides its input tensors: the kernel and its bounds
        and, for the loop, every entry's offsets."""
        e = self.entries
        return (self.kernel, e.max_q, e.max_k) + ((e.k_first, e.k_count) if self.kernel == "loop" else ())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**self.entries.tensors(), "write_rows": self.write_rows}

    def with_tensors(self, t: dict[str, torch.Tensor]) -> BatchIndex:
        e = dataclasses.replace(self.entries, cu_q=t["cu_q"], k_start=t["k_start"], k_used=t["k_used"])
        return BatchIndex(e, t["write_rows"], self.kernel)


def varlen_kernel(cfg, device, dtype, batch_invariant: bool = False, setting: str = "auto") -> str:
    """The batched attention kernel of a model's block steps (kernels.varlen_kernel decides);
    setting: the engine's varlen_kernel. Raises InputError as kernels.varlen_kernel does."""
    return kernels.varlen_kernel(torch.device(device).type, dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                 batch_invariant, setting)


def batch_index(starts, lengths, pads, los, n: int, device, max_k: int | None = None,
                kernel: str = "loop") -> BatchIndex:
    """The index of B sequences: sequence b's position 0 is buffer row starts[b], it has
    lengths[b] positions of which the first pads[b] are left padding (never attended), and its
    block's n rows start at position los[b] (right of its padding: block rows are never pads).
    max_k: a bound on the key counts (a captured step's bucket). Raises ValueError when a block
    reaches into the padding or past the sequence."""
    for L, p, lo in zip(lengths, pads, los):
        if not (p <= lo and lo + n <= L):
            raise ValueError(f"a block of rows [{lo}, {lo + n}) must lie in [{p}, {L}) (padding {p}, length {L})")
    ent = VL.entries([n] * len(starts), [s + p for s, p in zip(starts, pads)],
                     [L - p for L, p in zip(lengths, pads)], device, max_k)
    rows = [s + lo + i for s, lo in zip(starts, los) for i in range(n)]
    return BatchIndex(ent, ints_on(rows, device), kernel)


def batched_attention(ctx, model, lw, x, step: Step, layer: int) -> None:
    """x [B*n, d] += o_proj(attention) for every sequence of the step at once (module docstring)."""
    cfg = model.cfg
    spec = step.cache
    B, n = step.ids.shape
    pos = step.positions.reshape(-1)                                       # [B*n]
    h = ctx.rmsnorm("h_kv", x, lw["attn_norm"], cfg.rms_eps)              # [B*n, d]
    k = _lin(ctx, model, "k", h, lw, "k")                                  # [B*n, kv_dim]
    v = _lin(ctx, model, "v", h, lw, "v")
    _qk(ctx, model, k, lw.get("k_norm"), cfg.num_kv_heads, pos)
    q = _lin(ctx, model, "q", h, lw, "q")                                  # [B*n, q_dim]
    qh = _qk(ctx, model, q, lw.get("q_norm"), cfg.num_heads, pos)
    shared = spec.shared_kv(ctx, layer, cfg.kv_dim)
    if shared is None:
        o_all = _per_sequence(ctx, model, step, layer, k, v, qh)
    else:
        K, V = shared                                                       # [R, kv_dim] each
        ctx.kv_scatter(k, v, K, V, spec.index.write_rows)
        o_all = ctx.attention_varlen("attn_all", qh, _heads(K, cfg.num_kv_heads, cfg.head_dim),
                                     _heads(V, cfg.num_kv_heads, cfg.head_dim), spec.index.entries, spec.index.kernel)
    spec.release_layer(ctx, layer)
    y = _lin(ctx, model, "o_proj", o_all, lw, "o")
    ctx.add_(x, reduce_tp(ctx, model, y))


def _per_sequence(ctx, model, step: Step, layer: int, k, v, qh):
    """The fallback: each sequence's fresh rows copied into its own store, one attention each."""
    cfg = model.cfg
    B, n = step.ids.shape
    seqs = step.cache.sequence_kv(ctx, layer, B, cfg.kv_dim)              # (K_b, V_b, lo_b) per sequence

    def write():
        for b, (Kb, Vb, lo) in enumerate(seqs):
            Kb[lo:lo + n].copy_(k[b * n:(b + 1) * n])
            Vb[lo:lo + n].copy_(v[b * n:(b + 1) * n])
    ctx.custom("kv_write", write, k, v)
    o_all = ctx.new("attn_all", (B * n, cfg.q_dim))
    for b, (Kb, Vb, _) in enumerate(seqs):
        pad = step.pads[b] if step.pads else 0
        kh = _heads(Kb[pad:], cfg.num_kv_heads, cfg.head_dim)              # [L_b - pad, Hkv, hd]
        vh = _heads(Vb[pad:], cfg.num_kv_heads, cfg.head_dim)
        o = ctx.attention("attn_o", qh[b * n:(b + 1) * n], kh, vh)        # [n, q_dim]
        dst = o_all[b * n:(b + 1) * n]
        with ctx.op("attn_gather"):                                        # o_all's rows: written, not read
            ctx.use(o, writes=(dst,))
            if ctx.compute:
                dst.copy_(o)
    return o_all
