"""FP8 numerics, emulated on the CPU: the Triton activation quantizer gives the reference's codes
and scales bit for bit (interpreter), the emulated scaled matmul equals PyTorch's own, and the
errors are what e4m3 allows."""

import pytest
import torch

from mosaic.kernels import fp8 as FP8

E4M3 = FP8.E4M3


def both(x):
    n, d = x.shape
    a8, sa = torch.empty(n, d, dtype=E4M3), torch.empty(n)
    b8, sb = torch.empty(n, d, dtype=E4M3), torch.empty(n)
    FP8.quantize_rows_ref(a8, sa, x)
    FP8.quantize_rows(b8, sb, x, "triton")
    return (a8, sa), (b8, sb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e-3, 3.0, 1e4])
def test_triton_quantizer_matches_the_reference_bit_for_bit(dtype, scale):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 70, generator=g) * scale).to(dtype)
    x[3] = 0                                          # a zero row: scale 1, codes 0
    x[5, :4] = torch.tensor([1e-30, -1e-9, 5.0, -7.0]).to(dtype)
    (a8, sa), (b8, sb) = both(x)
    assert torch.equal(a8.view(torch.uint8), b8.view(torch.uint8)) and torch.equal(sa, sb)
    assert sa[3] == 1 and not a8[3].float().any()


def test_every_rounding_case_of_the_e4m3_grid():
    """Rows with scale exactly 1 (a 448 in each) sweep the whole e4m3 range, ties and
    subnormals included: the kernel's rounding equals PyTorch's cast everywhere."""
    grid = torch.cat([torch.linspace(-448, 448, 40001), torch.linspace(-0.03, 0.03, 20001)])
    grid = torch.cat([grid, torch.zeros(-grid.numel() % 999)]).view(-1, 999)
    x = torch.cat([torch.full((grid.shape[0], 1), 448.0), grid], 1)
    (a8, sa), (b8, sb) = both(x)
    assert bool((sa == 1).all())
    assert torch.equal(a8.view(torch.uint8), b8.view(torch.uint8))


def test_weight_quantization_error_is_within_e4m3_precision():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 96, generator=g)
    w8, s = FP8.quantize_weight(w)
    assert w8.dtype == E4M3 and s.shape == (64,)
    back = FP8.dequantize(w8, s)
    # 3 mantissa bits: relative error <= 2^-4 for normal values; small values are subnormal
    big = w.abs() > s[:, None] * 2 ** -6
    assert bool(((back - w).abs()[big] <= w.abs()[big] * 2 ** -4 + 1e-7).all())
    assert torch.allclose(back.abs().amax(1), w.abs().amax(1), rtol=1e-6)   # each row's max is exact


def test_emulated_scaled_mm_equals_pytorchs():
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(19, 48, generator=g), torch.randn(32, 48, generator=g), torch.randn(32, generator=g)
    x8, sx = torch.empty(19, 48, dtype=E4M3), torch.empty(19)
    FP8.quantize_rows_ref(x8, sx, x)
    w8, sw = FP8.quantize_weight(w)
    out = torch.empty(19, 32)
    FP8.scaled_mm(out, x8, sx, w8, sw, b)
    ref = torch._scaled_mm(x8, w8.t(), scale_a=sx[:, None], scale_b=sw[None, :], bias=b, out_dtype=torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    exact = x @ w.t() + b
    rel = (out - exact).norm() / exact.norm()
    assert 1e-3 < rel < 0.08                           # lossy, by the amount e4m3 implies


def test_quantize_weight_on_meta_keeps_shapes():
    w8, s = FP8.quantize_weight(torch.empty(10, 20, device="meta"))
    assert w8.shape == (10, 20) and w8.dtype == E4M3 and s.shape == (10,) and s.device.type == "meta"
