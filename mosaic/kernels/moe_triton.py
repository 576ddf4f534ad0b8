"""The routed experts in two Triton kernels (PyTorch reference and dispatch: moe.py,
kernels.moe_kernel 'triton'): opt-in, its summation order is its own (labelled lossy).

In the style of vLLM's fused_moe (vllm-project/vllm, model_executor/layers/fused_moe): the
routed rows, sorted by expert (moe.sort_by_expert), are cut into blocks of BM rows that never
straddle two experts; each program multiplies one block by one BN-column band of its expert's
weights, so a block reads only its expert's weights and an expert that no row reached is never
read. What differs: the block table is built by a few PyTorch ops from the sorted offsets with a
static worst-case size (num_blocks: no padded token list, no host sync), the gate and up bands
are multiplied in one program with SwiGLU in its epilogue (the reference's rounding points: gate
and up rounded to the model dtype, silu in fp32 rounded, the product rounded), the A rows are
read straight from h by their source row and the down projection's rows are written straight to
their (row, slot) place, so neither the gathered rows nor a scatter exist as tensors.

  experts    slots [R, d] <- h [n, d], order [R], offs [E]; act [R, F] and the block table
             [3, num_blocks] int32 are planned buffers (moe.triton_table_shape)

Tiles: BM by the mean rows per expert R / E (static), 16 under the interpreter. Nothing here
is tuned on a GPU yet: `python -m bench families --only moe` measures it beside
torch._grouped_mm and the loop."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import interpret

OPTS = {"enable_fp_fusion": False}   # no mul + add contraction in the epilogue (the reference's roundings)


def block_table(table: torch.Tensor, offs: torch.Tensor, bm: int) -> None:
    """table [3, B] int32 <- (expert, first row, end row) of each block of <= bm sorted rows of
    one expert; blocks past the last are empty (first row = end row = 0). No host sync."""
    ends = offs.long()                                                    # [E]
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    per = (counts + bm - 1) // bm                                         # blocks of each expert
    cum = torch.cumsum(per, 0)
    b = torch.arange(table.shape[1], device=offs.device)
    e = torch.searchsorted(cum, b, right=True)                            # [B]: E where no block
    ec = e.clamp(max=ends.shape[0] - 1)
    first = (ends[ec] - counts[ec]) + (b - (cum[ec] - per[ec])) * bm
    live = e < ends.shape[0]
    table[0] = ec
    table[1] = torch.where(live, first, 0)
    table[2] = torch.where(live, ends[ec], 0)


@triton.jit
def _gate_up(H, Order, Table, Wg, Wu, Act, F, d, k, nb, stride_h, stride_we, stride_wn, stride_a,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, LIBDEVICE: tl.constexpr):
    pid_b = tl.program_id(0)
    row0 = tl.load(Table + nb + pid_b)
    row1 = tl.load(Table + 2 * nb + pid_b)
    if row0 >= row1:
        return
    e = tl.load(Table + pid_b).to(tl.int64)
    rows = row0 + tl.arange(0, BM)
    mrow = rows < row1
    src = (tl.load(Order + rows, mask=mrow, other=0) // k).to(tl.int64)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = rn < F
    rk = tl.arange(0, BK)
    wbase = e * stride_we + rn.to(tl.int64)[:, None] * stride_wn
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, d, BK):
        kk = k0 + rk
        mk = kk < d
        a = tl.load(H + src[:, None] * stride_h + kk[None, :], mask=mrow[:, None] & mk[None, :], other=0.0)
        bg = tl.load(Wg + wbase + kk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        bu = tl.load(Wu + wbase + kk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        if IEEE:
            acc_g = tl.dot(a, tl.trans(bg), acc_g, input_precision="ieee")
            acc_u = tl.dot(a, tl.trans(bu), acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, tl.trans(bg), acc_g)
            acc_u = tl.dot(a, tl.trans(bu), acc_u)
    dt = Act.dtype.element_ty
    f = acc_g.to(dt).to(tl.float32)
    if LIBDEVICE:   # PyTorch's silu: expf and an IEEE division (elementwise_triton._silu_mul_kernel)
        act = libdevice.div_rn(f, 1.0 + libdevice.exp(-f)).to(dt)
    else:
        act = (f / (1.0 + tl.exp(-f))).to(dt)
    y = (act.to(tl.float32) * acc_u.to(dt).to(tl.float32)).to(dt)
    tl.store(Act + rows.to(tl.int64)[:, None] * stride_a + rn[None, :], y, mask=mrow[:, None] & mn[None, :])


@triton.jit
def _down(Act, Order, Table, Wd, Slots, F, d, nb, stride_a, stride_we, stride_wn, stride_s,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    pid_b = tl.program_id(0)
    row0 = tl.load(Table + nb + pid_b)
    row1 = tl.load(Table + 2 * nb + pid_b)
    if row0 >= row1:
        return
    e = tl.load(Table + pid_b).to(tl.int64)
    rows = row0 + tl.arange(0, BM)
    mrow = rows < row1
    r64 = rows.to(tl.int64)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mn = rn < d
    rk = tl.arange(0, BK)
    wbase = e * stride_we + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, F, BK):
        kk = k0 + rk
        mk = kk < F
        a = tl.load(Act + r64[:, None] * stride_a + kk[None, :], mask=mrow[:, None] & mk[None, :], other=0.0)
        b = tl.load(Wd + wbase + kk[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    dst = tl.load(Order + rows, mask=mrow, other=0).to(tl.int64)
    tl.store(Slots + dst[:, None] * stride_s + rn[None, :], acc.to(Slots.dtype.element_ty),
             mask=mrow[:, None] & mn[None, :])


def experts(slots: torch.Tensor, h: torch.Tensor, order: torch.Tensor, offs: torch.Tensor, k: int,
            w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, act: torch.Tensor,
            table: torch.Tensor, tiles: tuple[int, int, int, int, int]) -> None:
    """As moe.experts_grouped: slots [R, d] (row, slot order) of h [n, d] through the experts
    w_gate, w_up [E, F, d], w_down [E, d, F] (contiguous); act [R, F], table [3, B] int32 planned
    (moe.triton_table_shape); tiles: (BM, BN, BK, warps, stages), moe.tiles. Rows of experts not
    held (after offs[-1]) are left unwritten."""
    R, d = slots.shape
    F = w_gate.shape[1]
    if w_up.stride() != w_gate.stride() or w_gate.stride(-1) != 1 or w_down.stride(-1) != 1:
        raise ValueError("moe_triton.experts: the expert weights need one layout with contiguous rows")
    if R == 0:
        return
    bm, bn, bk, warps, stages = tiles
    block_table(table, offs, bm)
    nb = table.shape[1]
    ieee = h.dtype == torch.float32
    _gate_up[(nb, triton.cdiv(F, bn))](h, order, table, w_gate, w_up, act, F, d, k, nb, h.stride(0),
                                       w_gate.stride(0), w_gate.stride(1), act.stride(0), BM=bm, BN=bn, BK=bk,
                                       IEEE=ieee, LIBDEVICE=not interpret(), num_warps=warps, num_stages=stages,
                                       **OPTS)
    _down[(nb, triton.cdiv(d, bn))](act, order, table, w_down, slots, F, d, nb, act.stride(0), w_down.stride(0),
                                    w_down.stride(1), slots.stride(0), BM=bm, BN=bn, BK=bk, IEEE=ieee,
                                    num_warps=warps, num_stages=stages, **OPTS)
