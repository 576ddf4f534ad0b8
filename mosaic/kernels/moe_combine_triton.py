"""The MoE combine in one Triton kernel, the reference's bits (moe.combine_f32 /
combine_model_dtype): the k weighted slots of a row summed in slot order from zero with the same
IEEE operations and rounding points as the reference's 2k + 2 PyTorch ops (float32: product and
sum each rounded to fp32, then one cast; model dtype: product rounded to it, sum rounded to it),
launched with enable_fp_fusion=False so no product is contracted into an FMA. One launch per MoE
layer instead of ~3k + 2 (k = 8: 26), which in a captured step is what the combine costs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpret

OPTS = {"enable_fp_fusion": False}


@triton.jit
def _combine(Acc, Slots, W, Held, n, d, K: tl.constexpr, F32: tl.constexpr, HAS_HELD: tl.constexpr,
             BR: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    mr = rows < n
    m = mr[:, None] & (cols[None, :] < d)
    r64 = rows.to(tl.int64)
    dt = Acc.dtype.element_ty
    acc = tl.zeros((BR, BD), tl.float32)
    for j in tl.static_range(K):
        s = tl.load(Slots + (r64 * K + j)[:, None] * d + cols[None, :], mask=m, other=0.0)
        w = tl.load(W + r64 * K + j, mask=mr, other=0.0)
        if F32:
            acc = acc + s.to(tl.float32) * w.to(tl.float32)[:, None]
        else:
            p = (s.to(tl.float32) * w.to(tl.float32)[:, None]).to(dt)
            if HAS_HELD:
                keep = tl.load(Held + r64 * K + j, mask=mr, other=0)
                p = tl.where(keep[:, None] != 0, p, 0.0).to(dt)
            acc = (acc.to(dt).to(tl.float32) + p.to(tl.float32)).to(dt).to(tl.float32)
    tl.store(Acc + r64[:, None] * d + cols[None, :], acc.to(dt), mask=m)


def combine(acc: torch.Tensor, slots: torch.Tensor, w: torch.Tensor, fp32: bool, held=None) -> None:
    """acc [n, d] <- slots [n*k, d] weighted by w [n, k] (fp32: the fp32 sum, w fp32; else the
    model-dtype sum, w in the model dtype; held [n, k] bool or None), as moe.combine_f32 /
    combine_model_dtype. Every tensor contiguous."""
    n, k = w.shape
    d = acc.shape[1]
    if n == 0:
        return
    br, bd = (16, 16) if interpret() else (4, min(1024, triton.next_power_of_2(d)))
    held_t = held if held is not None else w
    _combine[(triton.cdiv(n, br), triton.cdiv(d, bd))](acc, slots, w.contiguous(), held_t, n, d, K=k, F32=fp32,
                                                       HAS_HELD=held is not None, BR=br, BD=bd, **OPTS)
