"""Norms, RoPE and SwiGLU: the fused Triton kernels (elementwise_triton.py) or the PyTorch op
chains (reference.py), chosen by kernels.want_triton. Both give the same bits (the fused kernels
repeat the reference's operations and rounding points; tests/kernels/test_elementwise.py checks
it under the interpreter, `python -m bench speed` on the GPU), so the choice is about speed
only and the plan is the same: the fused path uses the reference's own scratch buffers."""

from __future__ import annotations

from . import invariant as INV
from . import reference as R
from . import want_triton


def rmsnorm(out, x, w, eps, s1, s2, setting: str = "auto", invariant: bool = False, add=None) -> None:
    """See reference.rmsnorm: x, out [n, d]; s1, s2 fp32 scratch [tile, d]. invariant: each row's
    mean of squares summed by one program in a fixed order (kernels/invariant.row_mean) rather
    than by PyTorch's reduction, whose order is chosen by the tile's shape on CUDA. add [n, d]:
    x += add first, in place (a residual; fused into the squares' pass on the Triton path)."""
    mean = INV.row_mean if invariant else None
    if want_triton(x.device.type, setting) or (invariant and x.device.type == "cuda"):
        from . import elementwise_triton as T
        T.rmsnorm(out, x, w, eps, s1, s2, mean, add)
    else:
        if add is not None:
            x.add_(add)
        R.rmsnorm(out, x, w, eps, s1, s2, mean)


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
