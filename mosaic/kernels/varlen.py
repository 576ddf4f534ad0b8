"""Attention of many sequences in one call: each entry's own query rows against its own keys,
every entry's rows packed in shared buffers (variable lengths, nothing padded).

  q    [T, Hq, hd]   the query rows of every entry; entry e's are rows [q0_e, q0_e + nq_e)
  k, v [R, Hkv, hd]  a pool of key rows (a block store, or every store of a paged pool); entry e
                     reads rows [k0_e, k0_e + nk_e), wherever they lie (the pool need not be
                     packed: other requests' rows and free pages sit between entries)
  out  [T, Hq*hd]

An entry is one sequence of a block-cache step (its block of query rows against its prompt and
block cache) or, for block diffusion, one block of one sequence (block-causal attention is one
entry per block, each against the keys up to its own end).

Kernels (kernels.varlen_kernel picks one; `loop` is the CPU path and every other's oracle):
  loop       one attention call per entry (kernels/reference.attention, or with batch_invariant
             the per-sequence invariant kernel): each entry's values are exactly its values alone
  flash      torch.ops.aten._flash_attention_forward with cu_seqlens_q, cu_seqlens_k = each
             entry's first key row and seqused_k = its key count: FlashAttention-2's varlen forward
             (Dao 2023, github.com/Dao-AILab/flash-attention: BlockInfo reads the start from
             cu_seqlens_k[b] and the length from seqused_k[b]); grouped-query heads natively
  efficient  torch.ops.aten._efficient_attention_forward with seqstart_k / seqlen_k (xformers'
             memory-efficient kernel; fp32 inputs, or where flash is not built); equal heads only
  triton     Mosaic's own (kernels/varlen_triton.py): one program per (query tile, head, entry), no
             split over keys, block sizes from max_q alone: batch-invariant (batch_invariant mode's
             kernel on CUDA, alone and batched) and read from device tensors only
  gather     every entry's keys gathered into [E, max_k] by the device tensors alone, the unused
             ones masked, one SDPA call: nothing read on the host, so a captured step replays it
             for any entries (the CPU tests of captured batched steps); entries of equal query
             rows; it reads every key twice (the gather), so it is never chosen by default

Measured on one H200 (bench/results/gpu/session7/design_probe_29bb6f0.json; 32 heads x 128, bf16,
32 query rows per sequence against 1.06k-1.57k keys each, ms per layer, graph-replayed): batch
16: loop 0.399, flash 0.151, efficient 0.157; batch 64: 1.545 / 0.544 / 0.615. Neither varlen
kernel is bit-equal to the loop (relative error 3e-3 flash, 1.5e-4 efficient, bf16): a request's
tokens in a batched step may differ from its tokens alone (Generation.lossy says so)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import reference as R
from .host_ints import ints_on

KERNELS = ("loop", "flash", "efficient", "gather", "triton")


@dataclass(frozen=True)
class Entries:
    """Where each entry's query rows and keys lie. Host tuples (the loop's offsets) and their
    device tensors (the varlen kernels' inputs, rewritten in place before a captured replay).

    q_first, q_count, k_first, k_count: per entry, rows of q and of the key pool
    cu_q [E+1] int32 (cumulative query rows: entries are packed in q), k_start [E+1] int32 (each
    entry's first key row; the last value is unused), k_used [E] int32 (keys per entry);
    max_q, max_k: bounds of q_count / k_count (a captured step keys its graph by them)."""
    q_first: tuple[int, ...]
    q_count: tuple[int, ...]
    k_first: tuple[int, ...]
    k_count: tuple[int, ...]
    cu_q: torch.Tensor
    k_start: torch.Tensor
    k_used: torch.Tensor
    max_q: int
    max_k: int

    @property
    def num_entries(self) -> int:
        return len(self.q_count)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"cu_q": self.cu_q, "k_start": self.k_start, "k_used": self.k_used}


def entries(q_count, k_first, k_count, device, max_k: int | None = None) -> Entries:
    """Entries packed in q in order (entry e's rows follow entry e-1's) with keys anywhere in the
    pool. max_k: a bound on the key counts (default their maximum). Raises ValueError on
    negative counts or a max_k below a count."""
    q_count, k_first, k_count = tuple(map(int, q_count)), tuple(map(int, k_first)), tuple(map(int, k_count))
    if not (len(q_count) == len(k_first) == len(k_count)) or min(q_count + k_count + k_first, default=0) < 0:
        raise ValueError(f"entries need equal-length, non-negative counts; got {q_count}, {k_first}, {k_count}")
    bound = max(k_count, default=0) if max_k is None else int(max_k)
    if k_count and bound < max(k_count):
        raise ValueError(f"max_k {bound} is below a key count {max(k_count)}")
    q_first = tuple(sum(q_count[:e]) for e in range(len(q_count)))
    cu = list(q_first) + [sum(q_count)]
    # queued behind the device's work, not copied blocking (host_ints.py): no host wait per step
    i32 = dict(device=device, dtype=torch.int32)
    return Entries(q_first, q_count, k_first, k_count, ints_on(cu, **i32),
                   ints_on(list(k_first) + [0], **i32), ints_on(list(k_count), **i32),
                   max(q_count, default=0), bound)


def loop_into(out, q, k, v, ent: Entries, attend=None) -> None:
    """The reference: attend(out_e, q_e, k_e, v_e) per entry (default reference.attention, the
    per-sequence SDPA every unbatched step runs); an entry without keys reads nothing: zeros."""
    attend = attend or R.attention
    for q0, nq, k0, nk in zip(ent.q_first, ent.q_count, ent.k_first, ent.k_count):
        if nq == 0:
            continue
        if nk == 0:
            out[q0:q0 + nq].zero_()
            continue
        attend(out[q0:q0 + nq], q[q0:q0 + nq], k[k0:k0 + nk], v[k0:k0 + nk])


def flash_into(out, q, k, v, ent: Entries) -> None:
    """FlashAttention-2 varlen over the pool (module docstring): q [T, Hq, hd], k, v [R, Hkv,
    hd] (last dim contiguous, any row stride); bf16 / fp16."""
    o = torch.ops.aten._flash_attention_forward(
        q, k, v, ent.cu_q, ent.k_start, ent.max_q, max(1, ent.max_k), 0.0, False, False,
        scale=1 / math.sqrt(q.shape[-1]), seqused_k=ent.k_used)[0]
    out.view(o.shape).copy_(o)


def efficient_into(out, q, k, v, ent: Entries) -> None:
    """xformers' memory-efficient varlen kernel (module docstring): Hq == Hkv."""
    o = torch.ops.aten._efficient_attention_forward(
        q[None], k[None], v[None], None, ent.cu_q, ent.k_start, ent.max_q, max(1, ent.max_k), 0.0, 0, False,
        scale=1 / math.sqrt(q.shape[-1]), seqlen_k=ent.k_used)[0]
    out.view(o.shape[1:]).copy_(o[0])


def gather_into(out, q, k, v, ent: Entries) -> None:
    """The gather kernel (module docstring): q [E * nq, Hq, hd] with nq = every entry's query
    rows; reads ent's device tensors only."""
    E, nq = ent.num_entries, ent.max_q
    hq, hkv = q.shape[1], k.shape[1]
    span = torch.arange(max(1, ent.max_k), device=q.device)
    idx = (ent.k_start[:E, None].long() + span).clamp_(max=k.shape[0] - 1)          # [E, max_k]
    keep = span < ent.k_used[:, None]                                                 # [E, max_k]
    # the rows past an entry's keys belong to others or to no one (never written: any bits, NaN
    # included), and a masked NaN still poisons SDPA's sums: zeroed, not only masked
    live = keep[:, :, None, None]
    kk = torch.where(live, k[idx], 0).repeat_interleave(hq // hkv, dim=2).transpose(1, 2)   # [E, Hq, max_k, hd]
    vv = torch.where(live, v[idx], 0).repeat_interleave(hq // hkv, dim=2).transpose(1, 2)
    qq = q.view(E, nq, hq, -1).transpose(1, 2)                                        # [E, Hq, nq, hd]
    o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=keep[:, None, None, :])
    out.view(E, nq, hq, -1).copy_(o.transpose(1, 2))


def attention_into(out, q, k, v, ent: Entries, kernel: str = "loop", attend=None) -> None:
    """out [T, Hq*hd] = per entry softmax(q_e k_e^T / sqrt(hd)) v_e with the named kernel (KERNELS;
    kernels.varlen_kernel chooses). attend: the per-entry op of the loop. Raises ValueError on
    mismatched shapes or an unknown kernel."""
    _check(out, q, k, v, ent)
    if kernel == "loop":
        loop_into(out, q, k, v, ent, attend)
    elif kernel == "flash":
        flash_into(out, q, k, v, ent)
    elif kernel == "efficient":
        efficient_into(out, q, k, v, ent)
    elif kernel == "triton":
        from . import varlen_triton as T
        T.varlen_fwd(out, q, k, v, ent.cu_q, ent.k_start, ent.k_used, ent.max_q)
    elif kernel == "gather":
        if len(set(ent.q_count)) > 1:
            raise ValueError(f"the gather kernel needs equal query rows per entry, got {sorted(set(ent.q_count))}")
        gather_into(out, q, k, v, ent)
    else:
        raise ValueError(f"unknown varlen kernel {kernel!r}; one of {KERNELS}")


def external_bytes(kernel: str, ent_rows: int, num_entries: int, max_q: int, hq: int, hd: int,
                   itemsize: int, per_entry: int = 0, max_k: int = 0) -> int:
    """Bytes a call allocates outside the plan. loop: per_entry (the per-entry op's own, charged
    by its caller: SDPA's output, regrouped q and log-sum-exp of the largest entry); flash /
    efficient: the kernel's output [T, Hq, hd] and its fp32 log-sum-exp, padded per entry to
    whole 32-row (efficient) or 128-row tiles (flash's rounded copy), plus a small RNG state."""
    if kernel == "loop":
        return per_entry
    if kernel == "triton":   # writes into the planned output, allocates nothing
        return 0
    if kernel == "gather":   # gathered K and V (and their head-expanded copies), the mask, SDPA's output
        return 4 * num_entries * max(1, max_k) * hq * hd * itemsize + 2 * ent_rows * hq * hd * itemsize + \
            num_entries * max(1, max_k) * 9
    lse_rows = num_entries * (-(-max(1, max_q) // 128) * 128) + ent_rows
    return ent_rows * hq * hd * itemsize + hq * lse_rows * 4 + 64


def _check(out, q, k, v, ent: Entries) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"want q [T, Hq, hd], k = v [R, Hkv, hd]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    T, hq, hd = q.shape
    if k.shape[2] != hd or k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"q heads {hq} x {hd} do not group over k heads {k.shape[1]} x {k.shape[2]}")
    if tuple(out.shape) not in ((T, hq * hd), (T, hq, hd)):
        raise ValueError(f"out is {tuple(out.shape)}, want [{T}, {hq * hd}]")
    if sum(ent.q_count) != T:
        raise ValueError(f"the entries hold {sum(ent.q_count)} query rows, q has {T}")
    ends = [a + n for a, n in zip(ent.k_first, ent.k_count)]
    if ends and max(ends) > k.shape[0]:
        raise ValueError(f"an entry reads key rows up to {max(ends)}; the pool has {k.shape[0]}")
