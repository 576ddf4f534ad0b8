"""Log-sum-exp merge of one block's partial attention into a running fp32 accumulator (Triton):
one launch instead of the eight element-wise ops of reference.merge_partial, which sequence
parallelism runs once per (query chunk, K/V piece) pair.

Grid (row blocks, heads). Each program reads its rows' two log-sum-exps, forms
new = max + log(exp(acc_lse - max) + exp(lse - max)), rescales its [BM, hd] tile of the
accumulator by exp(acc_lse - new), adds the block's output (any float dtype, widened) times
exp(lse - new), and writes new to acc_lse."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge(ACC, ACC_LSE, OUT, LSE, NQ, HD, s_am, s_ah, s_om, s_oh, s_lh, s_lm,
           BM: tl.constexpr, BD: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < NQ
    rows = offs_m.to(tl.int64)
    al = tl.load(ACC_LSE + h * NQ + rows, mask=mask_m, other=0.0)
    bl = tl.load(LSE + h * s_lh + rows * s_lm, mask=mask_m, other=0.0)
    mx = tl.maximum(al, bl)
    new = mx + tl.log(tl.exp(al - mx) + tl.exp(bl - mx))
    a = tl.exp(al - new)
    b = tl.exp(bl - new)
    offs_d = tl.arange(0, BD)
    mask = mask_m[:, None] & (offs_d[None, :] < HD)
    pa = ACC + rows[:, None] * s_am + h * s_ah + offs_d[None, :]
    po = OUT + rows[:, None] * s_om + h * s_oh + offs_d[None, :]
    acc = tl.load(pa, mask=mask, other=0.0)
    o = tl.load(po, mask=mask, other=0.0).to(tl.float32)
    tl.store(pa, acc * a[:, None] + o * b[:, None], mask=mask)
    tl.store(ACC_LSE + h * NQ + rows, new, mask=mask_m)


def merge(acc: torch.Tensor, acc_lse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """acc [nq, H, hd] fp32 and acc_lse [H, nq] fp32, both contiguous, updated in place; o
    [nq, H, hd] any float dtype with a contiguous last dim; lse [H, nq] fp32, any strides."""
    nq, hq, hd = acc.shape
    if nq == 0:
        return
    bm = 64
    grid = (triton.cdiv(nq, bm), hq)
    _merge[grid](acc, acc_lse, o, lse, nq, hd, acc.stride(0), acc.stride(1), o.stride(0), o.stride(1),
                 lse.stride(0), lse.stride(1), BM=bm, BD=triton.next_power_of_2(hd))
