"""Fused elementwise kernels (Triton) that give the reference ops' exact bits.

Each kernel performs the same IEEE operations, in the same order and the same dtypes, as the
chain of PyTorch ops in reference.py it replaces, only without the round trips through memory:
multiplications, additions and subtractions in fp32 rounded to nearest, then a cast to the
storage dtype (round to nearest even) wherever the reference stores a tensor. Launched with
enable_fp_fusion=False, so no a*b - c*d is contracted into an FMA (which would round once
instead of twice). What is not fused keeps PyTorch's own kernel: the mean over the hidden size
in RMSNorm (its summation order is PyTorch's reduction tree) and the rsqrt of [rows] values.
silu's exp comes from libdevice (the CUDA math library's expf, as PyTorch's kernel calls).

Bytes per element of an RMSNorm over [n, d] bf16: 14 here (x read twice, fp32 squares written
and read once, out written) against 36 for the op chain (fp32 copy, squares, scaled copy, cast,
weight multiply), and 4 launches instead of 8. RoPE: one pass over q or k instead of eight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import interpret
from .reference import rope_cos_sin, row_tiles

OPTS = {"enable_fp_fusion": False}   # a compile option: never contract mul + add into an FMA


@triton.jit
def _square_kernel(X, SQ, n, d, stride_x, BR: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    m = (rows[:, None] < n) & (cols[None, :] < d)
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(SQ + r64 * d + cols[None, :], x * x, mask=m)


@triton.jit
def _add_square_kernel(X, Y, SQ, n, d, stride_x, stride_y, BR: tl.constexpr, BD: tl.constexpr):
    # x += y (rounded to x's dtype, as x.add_(y)), then the squares of the sum, as _square_kernel
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    m = (rows[:, None] < n) & (cols[None, :] < d)
    r64 = rows.to(tl.int64)[:, None]
    xv = tl.load(X + r64 * stride_x + cols[None, :], mask=m, other=0.0)
    yv = tl.load(Y + r64 * stride_y + cols[None, :], mask=m, other=0.0)
    t = (xv.to(tl.float32) + yv.to(tl.float32)).to(xv.dtype)
    tl.store(X + r64 * stride_x + cols[None, :], t, mask=m)
    x = t.to(tl.float32)
    tl.store(SQ + r64 * d + cols[None, :], x * x, mask=m)


@triton.jit
def _scale_kernel(X, R, W, OUT, n, d, stride_x, stride_o, stride_r, eps, BR: tl.constexpr, BD: tl.constexpr,
                  RSQRT: tl.constexpr, LIBDEVICE: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    m = (rows[:, None] < n) & (cols[None, :] < d)
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    r = tl.load(R + rows.to(tl.int64) * stride_r, mask=rows < n, other=1.0)
    if RSQRT:   # R holds mean(x^2): torch.rsqrt(var.add_(eps)) here, rsqrtf as PyTorch's CUDA kernel calls it
        if LIBDEVICE:
            r = libdevice.rsqrt(r + eps)
        else:   # the interpreter: numpy, as PyTorch's CPU rsqrt, 1 / sqrt
            r = 1.0 / tl.sqrt(r + eps)
    w = tl.load(W + cols, mask=cols < d, other=0.0).to(tl.float32)
    t = (x * r[:, None]).to(OUT.dtype.element_ty)                  # out.copy_(x * rsqrt(var))
    y = (t.to(tl.float32) * w[None, :]).to(OUT.dtype.element_ty)    # out.mul_(w)
    tl.store(OUT + r64 * stride_o + cols[None, :], y, mask=m)


def _grid2(n, d, br, bd):
    return (triton.cdiv(n, br), triton.cdiv(d, bd))


def _blocks(d: int) -> tuple[int, int]:
    if interpret():
        return 16, 16
    return 8, min(1024, triton.next_power_of_2(d))


# rsqrt(var + eps) inside the scale kernel (3 launches per norm instead of 5): libdevice's rsqrtf
# is the function PyTorch's CUDA rsqrt calls; tests/gpu/test_elementwise_gpu.py checks the bits
FUSED_RSQRT = True


def rmsnorm(out, x, w, eps, s1, s2, mean=None, add=None) -> None:
    """out = (x * rsqrt(mean(x^2) + eps)).to(out.dtype) * w, as reference.rmsnorm, exactly.

    x, out: [n, d] with unit column stride (out may alias x); w [d]; s1, s2: the reference's
    fp32 scratch [tile, d] (s1 holds the squares, s2's first column the row statistics). Rows
    go in the reference's tiles of s1.shape[0] rows, so PyTorch's mean reduces tensors of the
    same shape, hence with the same reduction tree and summation order. mean(out [r, 1], sq
    [r, d]): another row mean (invariant_triton.row_mean: the composed batch-invariant path,
    now rmsnorm_triton's bitwise oracle in the tests). add [n, d]:
    first x += add in place (the residual), in the same pass as the squares."""
    n, d = x.shape
    br, bd = _blocks(d)
    for a, b in row_tiles(n, s1.shape[0]):
        rows, xa, oa = b - a, x[a:b], out[a:b]
        sq, var = s1[:rows], s2[:rows, :1]
        if add is None:
            _square_kernel[_grid2(rows, d, br, bd)](xa, sq, rows, d, xa.stride(0), BR=br, BD=bd, **OPTS)
        else:
            ya = add[a:b]
            _add_square_kernel[_grid2(rows, d, br, bd)](xa, ya, sq, rows, d, xa.stride(0), ya.stride(0),
                                                        BR=br, BD=bd, **OPTS)
        if mean is None:
            torch.mean(sq, -1, keepdim=True, out=var)
        else:
            mean(var, sq)
        if not FUSED_RSQRT:
            torch.rsqrt(var.add_(eps), out=var)
        _scale_kernel[_grid2(rows, d, br, bd)](xa, var, w, oa, rows, d, xa.stride(0), oa.stride(0),
                                                var.stride(0), eps, BR=br, BD=bd, RSQRT=FUSED_RSQRT,
                                                LIBDEVICE=not interpret(), **OPTS)


@triton.jit
def _rope_kernel(T, C, S, n, half, stride_r, stride_h, F32: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    h = tl.program_id(1)
    j = tl.arange(0, BH)
    m = (rows[:, None] < n) & (j[None, :] < half)
    r64 = rows.to(tl.int64)[:, None]
    base = T + r64 * stride_r + h * stride_h
    x1 = tl.load(base + j[None, :], mask=m, other=0.0)
    x2 = tl.load(base + half + j[None, :], mask=m, other=0.0)
    c = tl.load(C + r64 * half + j[None, :], mask=m, other=0.0)
    s = tl.load(S + r64 * half + j[None, :], mask=m, other=0.0)
    if F32:  # LLaDA: every product and sum in fp32, one cast back at the end
        a = x1.to(tl.float32) * c - x2.to(tl.float32) * s
        b = x2.to(tl.float32) * c + x1.to(tl.float32) * s
    else:    # HF style: cos/sin cast to t's dtype, every product and sum rounds to it
        dt = x1.dtype
        c, s = c.to(dt).to(tl.float32), s.to(dt).to(tl.float32)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        a = ((f1 * c).to(dt).to(tl.float32) - (f2 * s).to(dt).to(tl.float32))
        b = ((f2 * c).to(dt).to(tl.float32) + (f1 * s).to(dt).to(tl.float32))
    tl.store(base + j[None, :], a.to(x1.dtype), mask=m)
    tl.store(base + half + j[None, :], b.to(x1.dtype), mask=m)


def rope_(t, positions, inv_freq, fp32: bool, c, s) -> None:
    """Rotate-half RoPE in place on t [n, H, hd] (unit stride in hd) over the first
    2 * len(inv_freq) dims, exactly as reference.rope_ (fp32=True: LLaDA; False: Dream /
    LLaDA-MoE). c, s: fp32 scratch [tile, half] for cos/sin (reference.rope_cos_sin, per tile)."""
    n, heads, _ = t.shape
    half = inv_freq.shape[0]
    br = 16 if interpret() else 32
    bh = triton.next_power_of_2(half)
    for a, b in row_tiles(n, c.shape[0]):
        cc, ss = c[: b - a], s[: b - a]
        rope_cos_sin(cc, ss, positions[a:b], inv_freq)
        ta = t[a:b]
        _rope_kernel[(triton.cdiv(b - a, br), heads)](ta, cc, ss, b - a, half, ta.stride(0), ta.stride(1),
                                                       F32=fp32, BR=br, BH=bh, **OPTS)


@triton.jit
def _rope_pair_kernel(T1, T2, C, S, n, half, H1, s1r, s1h, s2r, s2h, F32: tl.constexpr, BR: tl.constexpr,
                      BH: tl.constexpr):
    # _rope_kernel over two tensors in one launch: heads [0, H1) of T1, then T2's
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    h = tl.program_id(1)
    j = tl.arange(0, BH)
    m = (rows[:, None] < n) & (j[None, :] < half)
    r64 = rows.to(tl.int64)[:, None]
    if h < H1:
        base = T1 + r64 * s1r + h * s1h
    else:
        base = T2 + r64 * s2r + (h - H1) * s2h
    x1 = tl.load(base + j[None, :], mask=m, other=0.0)
    x2 = tl.load(base + half + j[None, :], mask=m, other=0.0)
    c = tl.load(C + r64 * half + j[None, :], mask=m, other=0.0)
    s = tl.load(S + r64 * half + j[None, :], mask=m, other=0.0)
    if F32:
        a = x1.to(tl.float32) * c - x2.to(tl.float32) * s
        b = x2.to(tl.float32) * c + x1.to(tl.float32) * s
    else:
        dt = x1.dtype
        c, s = c.to(dt).to(tl.float32), s.to(dt).to(tl.float32)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        a = ((f1 * c).to(dt).to(tl.float32) - (f2 * s).to(dt).to(tl.float32))
        b = ((f2 * c).to(dt).to(tl.float32) + (f1 * s).to(dt).to(tl.float32))
    tl.store(base + j[None, :], a.to(x1.dtype), mask=m)
    tl.store(base + half + j[None, :], b.to(x1.dtype), mask=m)


def rope_pair_(q, k, c, s, fp32: bool) -> None:
    """rope_ on q [n, Hq, hd] and k [n, Hk, hd] (either may be None; unit stride in hd) in one
    launch, with the step's cos / sin tables c, s [n, half] fp32 already computed (rope_tables)."""
    ts = [t for t in (q, k) if t is not None]
    t1, t2 = ts[0], ts[-1]
    n, half = t1.shape[0], c.shape[1]
    h1 = t1.shape[1]
    heads = h1 + (t2.shape[1] if len(ts) == 2 else 0)
    br = 16 if interpret() else 32
    _rope_pair_kernel[(triton.cdiv(n, br), heads)](t1, t2, c, s, n, half, h1, t1.stride(0), t1.stride(1),
                                                    t2.stride(0), t2.stride(1), F32=fp32, BR=br,
                                                    BH=triton.next_power_of_2(half), **OPTS)


@triton.jit
def _qkv_kernel(QKV, KO, VO, C, S, n, half, hd, Hq, Hk, s_r, k_r, v_r, F32: tl.constexpr, BR: tl.constexpr,
                BH: tl.constexpr, BD: tl.constexpr):
    # a fused q|k|v projection's rows [n, (Hq + 2 Hk) hd]: heads [0, Hq) rotated in place (q),
    # the next Hk rotated into KO (the store's rows), the last Hk copied into VO
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    h = tl.program_id(1)
    r64 = rows.to(tl.int64)[:, None]
    if h >= Hq + Hk:                                   # v: a copy of the whole head
        # names of their own: Triton types a name once across an if's branches, and the v
        # head's [BR, BD] mask is not the rotated halves' [BR, BH] (a CompilationError on sm_90)
        dv = tl.arange(0, BD)
        mv = (rows[:, None] < n) & (dv[None, :] < hd)
        xv = tl.load(QKV + r64 * s_r + h * hd + dv[None, :], mask=mv, other=0.0)
        tl.store(VO + r64 * v_r + (h - Hq - Hk) * hd + dv[None, :], xv, mask=mv)
    else:
        j = tl.arange(0, BH)
        m = (rows[:, None] < n) & (j[None, :] < half)
        src = QKV + r64 * s_r + h * hd
        dst = src
        if h >= Hq:
            dst = KO + r64 * k_r + (h - Hq) * hd
            dk = tl.arange(0, BD)                      # k: the unrotated tail dims move too
            mt = (rows[:, None] < n) & (dk[None, :] >= 2 * half) & (dk[None, :] < hd)
            tail = tl.load(src + dk[None, :], mask=mt, other=0.0)
            tl.store(dst + dk[None, :], tail, mask=mt)
        x1 = tl.load(src + j[None, :], mask=m, other=0.0)
        x2 = tl.load(src + half + j[None, :], mask=m, other=0.0)
        c = tl.load(C + r64 * half + j[None, :], mask=m, other=0.0)
        s = tl.load(S + r64 * half + j[None, :], mask=m, other=0.0)
        if F32:
            a = x1.to(tl.float32) * c - x2.to(tl.float32) * s
            b = x2.to(tl.float32) * c + x1.to(tl.float32) * s
        else:
            dt = x1.dtype
            c, s = c.to(dt).to(tl.float32), s.to(dt).to(tl.float32)
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            a = ((f1 * c).to(dt).to(tl.float32) - (f2 * s).to(dt).to(tl.float32))
            b = ((f2 * c).to(dt).to(tl.float32) + (f1 * s).to(dt).to(tl.float32))
        tl.store(dst + j[None, :], a.to(x1.dtype), mask=m)
        tl.store(dst + half + j[None, :], b.to(x1.dtype), mask=m)


def qkv_rope_store(qkv, k_out, v_out, c, s, hq: int, hk: int, hd: int, fp32: bool) -> None:
    """qkv [n, (hq + 2 hk) hd] (a fused projection's output, unit column stride): its q heads
    rotated in place, its k heads rotated into k_out [n, hk hd] and its v heads copied into v_out
    (the store's rows), with the step's tables c, s [n, half] fp32; one launch."""
    n, half = qkv.shape[0], c.shape[1]
    br = 16 if interpret() else 32
    _qkv_kernel[(triton.cdiv(n, br), hq + 2 * hk)](qkv, k_out, v_out, c, s, n, half, hd, hq, hk, qkv.stride(0),
                                                  k_out.stride(0), v_out.stride(0), F32=fp32, BR=br,
                                                  BH=triton.next_power_of_2(half), BD=triton.next_power_of_2(hd),
                                                  **OPTS)


@triton.jit
def _silu_mul_kernel(G, U, n, d, stride_g, stride_u, BR: tl.constexpr, BD: tl.constexpr,
                     LIBDEVICE: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    m = (rows[:, None] < n) & (cols[None, :] < d)
    r64 = rows.to(tl.int64)[:, None]
    g = tl.load(G + r64 * stride_g + cols[None, :], mask=m, other=0.0)
    u = tl.load(U + r64 * stride_u + cols[None, :], mask=m, other=0.0)
    f = g.to(tl.float32)
    if LIBDEVICE:  # the CUDA math library's expf and an IEEE division, as PyTorch's silu kernel
        act = libdevice.div_rn(f, 1.0 + libdevice.exp(-f)).to(g.dtype)
    else:          # the interpreter has no libdevice: numpy's exp
        act = (f / (1.0 + tl.exp(-f))).to(g.dtype)
    y = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)                  # g.mul_(u)
    tl.store(G + r64 * stride_g + cols[None, :], y, mask=m)


def silu_mul_(g, u) -> None:
    """g = silu(g) * u in place, g and u [n, F] with unit column stride, as reference.silu_mul_."""
    n, d = g.shape
    br, bd = _blocks(d)
    _silu_mul_kernel[_grid2(n, d, br, bd)](g, u, n, d, g.stride(0), u.stride(0), BR=br, BD=bd,
                                           LIBDEVICE=not interpret(), **OPTS)
