"""RMSNorm's one-pass kernel (kernels/rmsnorm_triton.py) under the interpreter (or on a GPU):
bitwise the composed batch-invariant path (square kernel -> invariant_triton.row_mean -> scale
kernel, the same block order: 16 columns a block here), each row's bits independent of the row
count, the reference one pass's math within fp32 rounding; and where kernels.rmsnorm_kernel
runs it; compiled for sm_90 without a GPU, the same reduction as row_mean. The bits at LLaDA-8B's
width on the GPU: tests/gpu/test_rmsnorm_gpu.py."""

import pytest
import torch
from hopper_compile import run_for_hopper

from mosaic.kernels import elementwise as E
from mosaic.kernels import interpret, rmsnorm_kernel
from mosaic.kernels import reference as R

pytestmark = pytest.mark.skipif(not (interpret() or torch.cuda.is_available()),
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() and not interpret() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


def composed(out, x, w, eps, add=None):
    """Today's batch-invariant path on the Triton kernels: three launches over fp32 scratch."""
    from mosaic.kernels import elementwise_triton as T
    from mosaic.kernels import invariant_triton as IT
    s1, s2 = (torch.empty(16, x.shape[1], device=DEV) for _ in range(2))
    T.rmsnorm(out, x, w, eps, s1, s2, IT.row_mean, add)


def one_pass(out, x, w, eps, add=None):
    from mosaic.kernels import rmsnorm_triton as N
    N.rmsnorm(out, x, w, eps, add)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_add", [False, True])
@pytest.mark.parametrize("n, d", [(1, 16), (5, 24), (37, 40), (9, 33), (3, 70)])
def test_one_pass_is_the_composed_invariant_path_bitwise(dtype, with_add, n, d):
    buf = rand(n + 3, d, dtype=dtype, seed=n + d)
    x = buf[2:2 + n]                                                   # a row slice of a larger buffer
    add = rand(n, d, dtype=dtype, seed=7) if with_add else None
    w = rand(d, dtype=dtype, seed=1, scale=0.2) + 1
    xw, xg = x.clone(), x.clone()
    want, got = torch.empty_like(x), torch.full_like(x, float("nan"))
    composed(want, xw, w, 1e-5, add)
    one_pass(got, xg, w, 1e-5, add)
    assert torch.equal(got, want)
    assert torch.equal(xg, xw)                                         # x += add, as the squares' pass
    assert torch.equal(buf[:2], rand(n + 3, d, dtype=dtype, seed=n + d)[:2])   # other rows untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_the_row_count(dtype):
    d = 40
    w = rand(d, dtype=dtype, seed=2, scale=0.2) + 1
    row = rand(1, d, dtype=dtype, seed=3)
    outs = []
    for n, seed in ((1, 0), (6, 4), (33, 5)):
        x = torch.cat([rand(n - 1, d, dtype=dtype, seed=seed), row]) if n > 1 else row.clone()
        out = torch.empty_like(x)
        one_pass(out, x, w, 1e-6)
        outs.append(out[-1])
    assert all(torch.equal(outs[0], o) for o in outs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_add", [False, True])
def test_one_pass_is_the_reference_math(dtype, with_add):
    """Against reference.rmsnorm_one_pass (the oracle: PyTorch's sum inside a block) and the
    default reference.rmsnorm (PyTorch's mean): equal within fp32 rounding; bf16 within the
    interpreter's truncating casts (two bf16 ulps; the GPU rounds as PyTorch does)."""
    from mosaic.kernels.invariant_triton import row_block
    n, d = 21, 72
    x, add = rand(n, d, dtype=dtype, seed=8), rand(n, d, dtype=dtype, seed=9) if with_add else None
    w = rand(d, dtype=dtype, seed=10, scale=0.2) + 1
    xr, xd, xg = x.clone(), x.clone(), x.clone()
    ref, dflt, got = (torch.empty_like(x) for _ in range(3))
    R.rmsnorm_one_pass(ref, xr, w, 1e-5, row_block(), add)
    if add is not None:
        xd.add_(add)
    R.rmsnorm(dflt, xd, w, 1e-5, *(torch.empty(n, d, device=DEV) for _ in range(2)))
    one_pass(got, xg, w, 1e-5, add)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2 ** -5)
    assert torch.allclose(xg.float(), xr.float(), **tol)
    assert torch.allclose(got.float(), ref.float(), **tol)
    assert torch.allclose(got.float(), dflt.float(), **tol)


def test_in_place_and_the_alias_it_refuses():
    x, w = rand(9, 24, seed=11), rand(24, seed=12)
    want = torch.empty_like(x)
    one_pass(want, x.clone(), w, 1e-6)
    one_pass(x, x, w, 1e-6)                                            # out is x (the final norm)
    assert torch.equal(x, want)
    with pytest.raises(ValueError, match="alias"):
        one_pass(x, x, w, 1e-6, add=x.clone())


def test_which_kernel_runs():
    """kernels.rmsnorm_kernel: one pass in batch-invariant mode on CUDA (whatever the setting) and
    where Triton runs when asked; on the CPU without Triton the default stays PyTorch's."""
    assert rmsnorm_kernel("cpu") == "torch" and rmsnorm_kernel("cpu", one_pass=True) == "torch"
    assert rmsnorm_kernel("cpu", invariant=True) == "torch"
    assert rmsnorm_kernel("cuda", "torch", invariant=True) == "one_pass"
    assert rmsnorm_kernel("cuda", "torch", one_pass=True) == "torch"
    assert rmsnorm_kernel("cuda", "auto", one_pass=True) == "one_pass"
    assert rmsnorm_kernel("cuda", "auto") == "triton"
    if DEV == "cpu":                                                   # the interpreter, when asked
        assert rmsnorm_kernel("cpu", "triton") == "triton"
        assert rmsnorm_kernel("cpu", "triton", one_pass=True) == "one_pass"
        assert rmsnorm_kernel("cpu", "triton", invariant=True) == "one_pass"


@pytest.mark.parametrize("setting", ["torch", "triton"])
def test_the_dispatch_needs_scratch_only_off_the_one_pass_path(setting):
    x, w = rand(13, 40, seed=13), rand(40, seed=14)
    want = torch.empty_like(x)
    one_pass(want, x.clone(), w, 1e-5)
    got = torch.empty_like(x)
    if setting == "torch":                                             # the reference: its scratch
        s1, s2 = (torch.empty(13, 40, device=DEV) for _ in range(2))
        E.rmsnorm(got, x.clone(), w, 1e-5, s1, s2, setting, one_pass=True)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    else:
        E.rmsnorm(got, x.clone(), w, 1e-5, None, None, setting, one_pass=True)
        assert torch.equal(got, want)


def test_the_one_pass_sums_as_row_mean_when_compiled_for_hopper():
    """tools/rmsnorm_compile_check.py: both kernels lowered to sm_90 by Triton and ptxas, no GPU:
    the squares tl.sum reduces have row_mean's register layout (bf16 and fp16 too, through the
    VEC hint) and the same reduction instructions, with and without the residual add."""
    r = run_for_hopper(["tools/rmsnorm_compile_check.py"])
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert r.stdout.count("ok ") == 6, r.stdout
