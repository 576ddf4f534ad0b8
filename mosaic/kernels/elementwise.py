"""Norms, RoPE and SwiGLU: the fused Triton kernels (elementwise_triton.py) or the PyTorch op
chains (reference.py), chosen by kernels.want_triton. Both give the same bits (the fused kernels
repeat the reference's operations and rounding points; tests/kernels/test_elementwise.py checks
it under the interpreter, `python -m bench speed` on the GPU), so the choice is about speed
only and the plan is the same: the fused path uses the reference's own scratch buffers. The
exception is RMSNorm's one-pass kernel (rmsnorm_triton.py: its own fixed sum order, no scratch),
run in batch-invariant mode and where a block step asks for it (kernels.rmsnorm_kernel)."""

from __future__ import annotations

from . import invariant as INV
from . import reference as R
from . import rmsnorm_kernel, want_triton


def rmsnorm(out, x, w, eps, s1=None, s2=None, setting: str = "auto", invariant: bool = False, add=None,
            one_pass: bool = False) -> None:
    """See reference.rmsnorm: x, out [n, d]; s1, s2 fp32 scratch [tile, d] (None where the kernel
    is one pass: kernels.rmsnorm_kernel chooses, and the planned ctx allocates by the same
    choice). add [n, d]: x += add first, in place (a residual; in the squares' pass on the Triton
    paths). invariant: each row's mean of squares summed in a fixed order (one program per row:
    rmsnorm_triton on CUDA; on the CPU PyTorch's mean, which is per row) rather than by PyTorch's
    CUDA reduction, whose order is chosen by the tile's shape. one_pass: the one-pass kernel
    where Triton runs (its sum order differs from PyTorch's mean: opt-in)."""
    kernel = rmsnorm_kernel(x.device.type, setting, invariant, one_pass)
    if kernel == "one_pass":
        from . import rmsnorm_triton as N
        N.rmsnorm(out, x, w, eps, add)
    elif kernel == "triton":
        from . import elementwise_triton as T
        T.rmsnorm(out, x, w, eps, s1, s2, None, add)
    else:
        if add is not None:
            x.add_(add)
        R.rmsnorm(out, x, w, eps, s1, s2, INV.row_mean if invariant else None)


def rope_pair_(q, k, c, s, fp32, s1, s2, setting: str = "auto") -> None:
    """reference.rope_tabled_ on q [n, Hq, hd] and on k [n, Hk, hd] (either may be None) with the
    step's cos / sin tables c, s [n, half] fp32; one launch for both on the Triton path. s1, s2:
    scratch [tile, max(Hq, Hk), half] in the compute dtype (the reference path's)."""
    if want_triton((q if q is not None else k).device.type, setting):
        from . import elementwise_triton as T
        T.rope_pair_(q, k, c, s, fp32)
        return
    for t in (q, k):
        if t is not None:
            R.rope_tabled_(t, c, s, fp32, s1, s2)


def rope_(t, positions, inv_freq, fp32, s1, s2, c, s, setting: str = "auto", invariant: bool = False) -> None:
    """See reference.rope_: t [n, H, hd] in place; s1, s2 [tile, H, half]; c, s [tile, half] fp32.
    invariant: the CPU's sin/cos independent of the row count (kernels/invariant.pointwise_rows)."""
    if want_triton(t.device.type, setting):
        from . import elementwise_triton as T
        T.rope_(t, positions, inv_freq, fp32, c, s)
    else:
        R.rope_(t, positions, inv_freq, fp32, s1, s2, c, s, INV.rope_cos_sin if invariant else None)


def silu_mul_(g, u, setting: str = "auto", invariant: bool = False) -> None:
    """See reference.silu_mul_: g = silu(g) * u in place, [n, F]. invariant: on the CPU, each
    row's bits independent of the row count (kernels/invariant.pointwise_rows)."""
    if want_triton(g.device.type, setting):
        from . import elementwise_triton as T
        T.silu_mul_(g, u)
    elif invariant:
        INV.silu_mul_(g, u)
    else:
        R.silu_mul_(g, u)


def qkv_rope_store(qkv, k_out, v_out, c, s, hq: int, hk: int, hd: int, fp32: bool, s1, s2,
                   setting: str = "auto") -> None:
    """A fused q|k|v projection's rows qkv [n, (hq + 2 hk) hd]: k and v written into k_out, v_out
    [n, hk hd] (the store's rows), then q (in place) and k_out rotated with the step's tables c, s
    [n, half] fp32, as rope_pair_ would; one launch on the Triton path."""
    if want_triton(qkv.device.type, setting):
        from . import elementwise_triton as T
        T.qkv_rope_store(qkv, k_out, v_out, c, s, hq, hk, hd, fp32)
        return
    qd, kd = hq * hd, hk * hd
    k_out.copy_(qkv[:, qd:qd + kd])
    v_out.copy_(qkv[:, qd + kd:qd + 2 * kd])
    n = qkv.shape[0]
    rope_pair_(qkv[:, :qd].view(n, hq, hd), k_out.view(n, hk, hd), c, s, fp32, s1, s2, "torch")
