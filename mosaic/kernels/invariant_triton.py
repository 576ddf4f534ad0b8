"""Batch-invariant Triton kernels (PyTorch reference and dispatch: invariant.py).

matmul: out [M, N] = x [M, K] @ w [N, K]^T (+ bias), fp32 accumulation, one rounding to out's
dtype. Grid (M tiles x N tiles) in grouped order (GROUP_M row tiles share a band of w in L2).
No autotuning and no split-K: every output element's K loop runs in one program, BK columns at
a time in order, with one BK per dtype and one MMA family, so a row's bits depend only on its
own inputs, never on M. The output tile follows the shape (invariant_tiles.py: 128 x 128 for
large M, as Thinking Machines' batch_invariant_ops; 64-row tiles and narrower ones for the few
rows of a block step, so that they fill the SMs); under the interpreter 16 x 16 x 16.

row_mean: out [n, 1] fp32 = the mean of each row of x [n, d] fp32: one program per row, blocks
of 1024 columns summed in order (a fixed tree inside each block). The norms no longer call it:
rmsnorm_triton's one pass sums in this order (its bitwise oracle: the composed path square ->
row_mean -> scale, tests/gpu/test_rmsnorm_gpu.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpret
from .invariant_tiles import INTERPRET, Tile
from .invariant_tiles import tile as choose_tile

GROUP_M = 8
ROW_BLOCK = 1024
ROW_WARPS = 4       # Triton's default: the layout (and so the tree) rmsnorm_triton repeats
_SMS: dict[int, int] = {}   # CUDA device index -> its SM count


def row_block() -> int:
    """Columns per block of a row's sum: ROW_BLOCK, or 16 under the interpreter (small tests
    still cross blocks)."""
    return 16 if interpret() else ROW_BLOCK


@triton.jit(do_not_specialize=["M"])   # the row count changes every step: one compile per tile
def _matmul(X, W, B, OUT, M, N, K, stride_x, stride_w, stride_o,
            HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP * num_n
    first_m = (pid // per_group) * GROUP
    size_m = tl.minimum(num_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mask_m = rm < M
    mask_n = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(X + rm64[:, None] * stride_x + kk[None, :], mask=mask_m[:, None] & (kk[None, :] < K), other=0.0)
        b = tl.load(W + rn64[:, None] * stride_w + kk[None, :], mask=mask_n[:, None] & (kk[None, :] < K), other=0.0)
        if IEEE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + rm64[:, None] * stride_o + rn64[None, :], acc.to(OUT.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the tile rule asks at every call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def tile_for(x: torch.Tensor, n: int) -> Tile:
    """The tile matmul launches for x [M, K] times n output columns (invariant_tiles.tile)."""
    if interpret() or x.device.type != "cuda":
        return INTERPRET
    return choose_tile(x.shape[0], n, x.dtype, num_sms(x.device))


def matmul(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           tile: Tile | None = None) -> None:
    """out [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]); every tensor with a contiguous last dim,
    one dtype. tile: force one (tests and benchmarks; a tile whose BK or MMA family differs from
    tile_for's gives other bits); default tile_for(x, N). Raises ValueError for other layouts."""
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K or tuple(out.shape) != (M, N) or x.dtype != w.dtype:
        raise ValueError(f"matmul: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}, out {tuple(out.shape)}")
    if min(x.stride(-1), w.stride(-1), out.stride(-1)) != 1 and M:
        raise ValueError("matmul: x, w and out need a contiguous last dim")
    if M == 0:
        return
    t = tile or tile_for(x, N)
    grid = (triton.cdiv(M, t.bm) * triton.cdiv(N, t.bn),)
    _matmul[grid](x, w, bias if bias is not None else w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                  HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BM=t.bm, BN=t.bn, BK=t.bk,
                  GROUP=GROUP_M, num_warps=t.warps, num_stages=t.stages)


@triton.jit(do_not_specialize=["n"])
def _row_mean(X, OUT, n, d, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = 0.0
    for c0 in range(0, d, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        acc += tl.sum(tl.load(X + row * stride_x + cols, mask=cols < d, other=0.0).to(tl.float32))
    tl.store(OUT + row * stride_o, acc / d)


def row_mean(out: torch.Tensor, x: torch.Tensor) -> None:
    """out [n, 1] fp32 = mean(x [n, d], -1), one program per row."""
    n, d = x.shape
    if n == 0:
        return
    _row_mean[(n,)](x, out, n, d, x.stride(0), out.stride(0), BLOCK=row_block(), num_warps=ROW_WARPS)
