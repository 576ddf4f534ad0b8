"""Batched (varlen) attention in Triton: every entry of kernels/varlen.py in one launch, each
program one (query tile, head, entry), walking the entry's own keys with FlashAttention-2's inner
loop (attention_triton._step, Dao 2023) and no split over keys.

Grid (cdiv(max_q, BLOCK_M), Hq, E). A program reads its entry's first query row (cu_q[e]), row
count (cu_q[e+1] - cu_q[e]), first key row (k_start[e]) and key count (k_used[e]) from device
tensors, so a captured step replays it for any entries; it never reads another entry's rows.

Batch-invariant by construction: an entry's tiles, their order and the block sizes depend only on
the entry itself and on max_q (the block rows of a step, the same alone and batched), never on
the other entries or on E. That is what batch-invariant mode needs from a batched step's
attention: a request's values in a batched step are its values alone (its alone block steps run
this kernel too: models/kv_cache.cached_step). Block sizes are fixed, not autotuned by timing.
The PyTorch oracle is kernels/varlen.loop_into."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import interpret
from .attention_triton import NEG, _step


@triton.jit
def _varlen_fwd(Q, K, V, Out, CuQ, KStart, KUsed, sm_scale,
                stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_om, stride_oh,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, G: tl.constexpr, IEEE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    e = tl.program_id(2)
    q0 = tl.load(CuQ + e).to(tl.int64)
    nq = tl.load(CuQ + e + 1).to(tl.int64) - q0
    k0 = tl.load(KStart + e).to(tl.int64)
    nk = tl.load(KUsed + e).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < nq
    d_ok = offs_d[None, :] < HEAD_DIM
    q_ptrs = Q + (q0 + offs_m)[:, None] * stride_qm + h * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok, other=0.0)
    kvh = h // G
    Kb = K + k0 * stride_kn                      # the entry's keys start here: rows 0 .. nk - 1
    Vb = V + k0 * stride_vn
    total = tl.where(pid_m * BLOCK_M < nq, tl.cdiv(nk, BLOCK_N), 0)
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full((BLOCK_M,), NEG, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    k_col = kvh * stride_kh
    v_col = kvh * stride_vh
    zero = tl.full((), 0, tl.int64)
    for t in tl.range(0, total - 1):
        acc, l_i, m_i = _step(acc, l_i, m_i, q, Kb, Vb, None, None, zero + t * BLOCK_N, k_col, v_col, stride_kn,
                              stride_vn, nk, offs_n, offs_d, qk_scale, False, HEAD_DIM, BLOCK_D, False, IEEE)
    if total > 0:
        acc, l_i, m_i = _step(acc, l_i, m_i, q, Kb, Vb, None, None, zero + (total - 1) * BLOCK_N, k_col, v_col,
                              stride_kn, stride_vn, nk, offs_n, offs_d, qk_scale, True, HEAD_DIM, BLOCK_D, False,
                              IEEE)
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = Out + (q0 + offs_m)[:, None] * stride_om + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok)


def block_sizes(max_q: int, tuned: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) from max_q alone (a function of the step's block rows,
    the same alone and batched): the smallest query tile of 32 / 64 / 128 rows holding max_q, 64
    keys per tile; the interpreter's one small tile."""
    if not tuned:
        return 16, 16, 1, 1
    bm = 32 if max_q <= 32 else 64 if max_q <= 64 else 128
    return bm, 64, 4 if bm <= 64 else 8, 2


def varlen_fwd(out, q, k, v, cu_q, k_start, k_used, max_q: int, scale: float | None = None) -> None:
    """out [T, Hq*hd] (or [T, Hq, hd]) for q [T, Hq, hd] and k, v [R, Hkv, hd] (last dims
    contiguous), entries as kernels/varlen.Entries' device tensors (int32)."""
    T, hq, hd = q.shape
    E = k_used.shape[0]
    if T == 0 or E == 0:
        return
    tuned = not interpret() and q.device.type == "cuda"
    bm, bn, warps, stages = block_sizes(max_q, tuned)
    stride_oh = out.stride(1) if out.dim() == 3 else hd
    grid = (triton.cdiv(max(1, max_q), bm), hq, E)
    _varlen_fwd[grid](q, k, v, out, cu_q, k_start, k_used, scale if scale is not None else 1.0 / math.sqrt(hd),
                      q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
                      stride_oh, HEAD_DIM=hd, BLOCK_D=max(16, triton.next_power_of_2(hd)), G=hq // k.shape[1],
                      IEEE=q.dtype == torch.float32 or not tuned, BLOCK_M=bm, BLOCK_N=bn,
                      **({"num_warps": warps, "num_stages": stages} if tuned else {}))
