"""RMSNorm in one launch (Triton): out = (x * rsqrt(mean(x^2) + eps)).to(out.dtype) * w, with
the residual x += add first where given (in place), one program per row, no scratch.

Each program sums its row's squares in fp32 in one fixed order: blocks of ROW_BLOCK = 1024
columns (16 under the interpreter), each reduced by tl.sum's tree, the block sums added in
column order. The order depends on d alone, never on the row count (batch-invariant), and it is
the composed invariant path's (elementwise_triton's square kernel -> invariant_triton.row_mean
-> scale kernel, three launches): the same block size, the same tl.sum over a tensor of the same
shape and register layout, so Triton emits the same tree and batch-invariant mode keeps its bits.
Against PyTorch's mean (the default path: its tree follows the tile's shape) the order differs,
so a Fast-dLLM block step runs it only when asked (fused_projections: all, labelled).

Why VEC: tl.sum's tree follows the register layout of the tensor it reduces, which Triton picks
from the loads' width, 16 bytes a thread: 4 fp32 squares in row_mean, but 8 bf16 values here.
The column offsets are hinted contiguous in runs of VEC = 4 only, so every dtype loads 4 values
a thread as row_mean does: the layout of 4 values x 32 threads x 4 warps (ROW_WARPS) in both
(tools/rmsnorm_compile_check.py compiles both for sm_90 without a GPU and compares the layouts
and the reduction's instructions; tests/gpu/test_rmsnorm_gpu.py compares the bits). The rest
repeats _scale_kernel's operations: libdevice's rsqrtf of mean + eps (the interpreter: 1 / sqrt),
x * r rounded once to out's dtype, then * w in fp32 rounded again. Bytes per element (bf16, no
add): x read twice (the second time from cache: a row is 8 KiB at d = 4096), w read, out written.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import interpret
from .elementwise_triton import OPTS
from .invariant_triton import ROW_WARPS, row_block

VEC = 4   # values per thread per load: row_mean's (16-byte loads of fp32 squares)


@triton.jit
def _rmsnorm_rows(X, A, W, OUT, d, stride_x, stride_a, stride_o, eps, HAS_ADD: tl.constexpr,
                  BLOCK: tl.constexpr, VEC: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    xr, ar, orow = X + row * stride_x, A + row * stride_a, OUT + row * stride_o
    acc = 0.0
    for c0 in range(0, d, BLOCK):     # row_mean's loop: block sums added in column order
        cols = tl.max_contiguous(c0 + tl.arange(0, BLOCK), VEC)
        x = tl.load(xr + cols, mask=cols < d, other=0.0)
        if HAS_ADD:                   # x + add rounded to x's dtype, as x.add_(add); stored below
            x = (x.to(tl.float32) + tl.load(ar + cols, mask=cols < d, other=0.0).to(tl.float32)).to(x.dtype)
        f = x.to(tl.float32)
        acc += tl.sum(f * f)
    mean = acc / d
    if LIBDEVICE:
        r = libdevice.rsqrt(mean + eps)
    else:
        r = 1.0 / tl.sqrt(mean + eps)
    for c0 in range(0, d, BLOCK):
        cols = tl.max_contiguous(c0 + tl.arange(0, BLOCK), VEC)
        m = cols < d
        x = tl.load(xr + cols, mask=m, other=0.0)
        if HAS_ADD:                   # each element read, then written, by this iteration only
            x = (x.to(tl.float32) + tl.load(ar + cols, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(xr + cols, x, mask=m)
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        t = (x.to(tl.float32) * r).to(OUT.dtype.element_ty)               # out.copy_(x * rsqrt(var))
        tl.store(orow + cols, (t.to(tl.float32) * w).to(OUT.dtype.element_ty), mask=m)   # out.mul_(w)


def rmsnorm(out, x, w, eps: float, add=None) -> None:
    """out [n, d] = (x * rsqrt(mean(x^2) + eps)).to(out.dtype) * w [d], one launch of n programs;
    add [n, d]: x += add first, in place. x, add, out with unit column stride; out may alias x
    without add (each element read, then written, by one program). Raises ValueError for out
    aliasing x with add (two stores of one element, from threads that need not be the same)."""
    n, d = x.shape
    if add is not None and out.data_ptr() == x.data_ptr():
        raise ValueError("rmsnorm with add: out must not alias x")
    if n == 0:
        return
    a = x if add is None else add
    _rmsnorm_rows[(n,)](x, a, w, out, d, x.stride(0), a.stride(0), out.stride(0), eps, HAS_ADD=add is not None,
                        BLOCK=row_block(), VEC=VEC, LIBDEVICE=not interpret(), num_warps=ROW_WARPS, **OPTS)
