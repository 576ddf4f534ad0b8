"""RMSNorm's one-pass kernel (kernels/rmsnorm_triton.py) on the GPU at LLaDA-8B's width (d =
4096; 128: a per-head q/k norm): bitwise the composed batch-invariant path it replaces (square
kernel -> invariant_triton.row_mean -> scale kernel: the same 1024-column blocks, the same tl.sum
tree), with and without the residual add, in bf16 and fp32; each row's bits independent of the
row count; within a bf16 ulp of PyTorch's reference (its mean sums in another order). The engine
side (batch-invariant tokens, block steps): tests/gpu/test_batch_invariant_gpu.py,
tests/gpu/test_fused_gpu.py. Skipped without CUDA."""

import pytest
import torch
from conftest import needs_cuda

from mosaic.kernels import reference as R

pytestmark = [pytest.mark.gpu, needs_cuda]


def _inputs(n, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n + 2, d, generator=g) * 3).to("cuda", dtype)[1:1 + n]    # rows of a larger buffer
    add = torch.randn(n, d, generator=g).to("cuda", dtype)
    w = (1 + 0.2 * torch.randn(d, generator=g)).to("cuda", dtype)
    return x, add, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_add", [False, True])
@pytest.mark.parametrize("n", [1, 7, 32, 512])
@pytest.mark.parametrize("d", [4096, 128])
def test_one_pass_bits_equal_the_composed_invariant_path(d, n, with_add, dtype):
    from mosaic.kernels import elementwise_triton as T
    from mosaic.kernels import invariant_triton as IT
    from mosaic.kernels import rmsnorm_triton as N
    x, add, w = _inputs(n, d, dtype, seed=n)
    add = add if with_add else None
    s1, s2 = (torch.empty(min(n, R.ROW_TILE), d, device="cuda") for _ in range(2))
    xc, xo = x.clone(), x.clone()
    want, got = torch.empty_like(x), torch.full_like(x, float("nan"))
    T.rmsnorm(want, xc, w, 1e-5, s1, s2, IT.row_mean, add)
    N.rmsnorm(got, xo, w, 1e-5, add)
    torch.cuda.synchronize()
    assert torch.equal(xo, xc)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max().item()
    ref = torch.empty_like(x)
    R.rmsnorm(ref, xo.clone(), w, 1e-5, s1, s2)                                # PyTorch's mean
    assert torch.allclose(got.float(), ref.float(), rtol=2 ** -6 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_bits_do_not_depend_on_the_row_count(dtype):
    from mosaic.kernels import rmsnorm_triton as N
    x, add, w = _inputs(512, 4096, dtype, seed=3)
    outs = []
    for n in (1, 7, 32, 512):
        xs, out = x[:n].clone(), torch.empty(n, 4096, device="cuda", dtype=dtype)
        N.rmsnorm(out, xs, w, 1e-5, add[:n])
        outs.append((out[0].clone(), xs[0].clone()))
    assert all(torch.equal(outs[0][0], o) and torch.equal(outs[0][1], s) for o, s in outs)
