"""The fused elementwise kernels give the reference op chains' bits. On the GPU every case is
bit-exact; under the CPU interpreter fp32 RMSNorm and RoPE are bit-exact, while bf16 results are
checked to two bf16 ulps (the interpreter casts fp32 to bf16 by truncation, the GPU rounds to
nearest even as PyTorch does) and SwiGLU to one ulp (PyTorch's CPU exp is Sleef's, the
interpreter's numpy's)."""

import pytest
import torch

from mosaic.kernels import elementwise as E
from mosaic.kernels import interpret
from mosaic.kernels import reference as R

pytestmark = pytest.mark.skipif(not (interpret() or torch.cuda.is_available()),
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() and not interpret() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def same(got, want):
    if DEV == "cuda" or got.dtype == torch.float32:
        assert torch.equal(got, want)
    else:  # interpreter: truncating bf16 casts
        assert torch.allclose(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -5)


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, d, tile", [(5, 24, 5), (37, 40, 16), (70, 33, 32)])
def test_rmsnorm_bits(dtype, n, d, tile):
    x = rand(n + 3, d, dtype=dtype, seed=n)[2: 2 + n]                # a row slice of a larger buffer
    w = rand(d, dtype=dtype, seed=1, scale=0.2) + 1
    s1, s2 = (torch.empty(tile, d, device=DEV) for _ in range(2))
    want, got = torch.empty_like(x), torch.full_like(x, float("nan"))
    R.rmsnorm(want, x, w, 1e-5, s1, s2)
    E.rmsnorm(got, x, w, 1e-5, s1, s2, setting="triton")
    same(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_in_place(dtype):
    x = rand(9, 16, dtype=dtype, seed=3)
    w = rand(16, dtype=dtype, seed=4)
    s1, s2 = (torch.empty(4, 16, device=DEV) for _ in range(2))
    want = torch.empty_like(x)
    R.rmsnorm(want, x.clone(), w, 1e-6, s1, s2)
    E.rmsnorm(x, x, w, 1e-6, s1, s2, setting="triton")
    same(x, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp32", [True, False])
@pytest.mark.parametrize("n, heads, hd, rot", [(7, 3, 8, 8), (40, 2, 16, 8), (33, 4, 12, 12)])
def test_rope_bits(dtype, fp32, n, heads, hd, rot):
    buf = rand(n, heads * hd + 8, dtype=dtype, seed=n * heads)       # rows of a wider buffer
    t = buf[:, 4: 4 + heads * hd].view(n, heads, hd)
    pos = torch.arange(100, 100 + n, device=DEV)
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=DEV) / rot))
    half, tile = rot // 2, 16
    sdt = torch.float32 if fp32 else dtype
    s1, s2 = (torch.empty(tile, heads, half, device=DEV, dtype=sdt) for _ in range(2))
    c, s = (torch.empty(tile, half, device=DEV) for _ in range(2))
    want = t.clone()
    R.rope_(want, pos, inv, fp32, s1, s2, c, s)
    E.rope_(t, pos, inv, fp32, s1, s2, c, s, setting="triton")
    same(t, want)
    assert torch.equal(buf[:, :4], rand(n, heads * hd + 8, dtype=dtype, seed=n * heads)[:, :4])  # untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g, u = rand(19, 45, dtype=dtype, seed=5, scale=3), rand(19, 45, dtype=dtype, seed=6)
    want = g.clone()
    R.silu_mul_(want, u)
    E.silu_mul_(g, u, setting="triton")
    if DEV == "cuda":  # libdevice expf is the CUDA math library's, as PyTorch's kernel
        assert torch.equal(g, want)
    else:
        ulp = 1e-6 if dtype == torch.float32 else 2 ** -6
        assert torch.allclose(g.float(), want.float(), rtol=ulp, atol=ulp)


def test_torch_setting_is_the_reference():
    g, u = rand(4, 8, seed=7), rand(4, 8, seed=8)
    want = g.clone()
    R.silu_mul_(want, u)
    E.silu_mul_(g, u, setting="torch")
    assert torch.equal(g, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused_rsqrt", [True, False])
def test_rmsnorm_with_residual_add(dtype, fused_rsqrt, monkeypatch):
    """x += y in the squares' pass, then the norm: the reference's x.add_(y) and rmsnorm; with
    rsqrt(var + eps) inside the scale kernel or as PyTorch's two ops."""
    from mosaic.kernels import elementwise_triton as T
    monkeypatch.setattr(T, "FUSED_RSQRT", fused_rsqrt)
    x, y = rand(21, 40, dtype=dtype, seed=7), rand(21, 40, dtype=dtype, seed=8)
    w = rand(40, dtype=dtype, seed=9, scale=0.2) + 1
    s1, s2 = (torch.empty(16, 40, device=DEV) for _ in range(2))
    xr, want = x.clone(), torch.empty_like(x)
    xr.add_(y)
    R.rmsnorm(want, xr, w, 1e-5, s1, s2)
    got = torch.full_like(x, float("nan"))
    E.rmsnorm(got, x, w, 1e-5, s1, s2, setting="triton", add=y)
    same(x, xr)
    same(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp32", [True, False])
@pytest.mark.parametrize("hq, hk, hd, rot", [(4, 4, 8, 8), (6, 2, 16, 8), (3, 1, 12, 12)])
def test_rope_pair_with_tables_equals_rope(dtype, fp32, hq, hk, hd, rot):
    """q and k rotated in one launch from the step's tables = each rotated by rope_ alone."""
    n = 37
    qbuf = rand(n, hq * hd + 4, dtype=dtype, seed=hq)                  # q: rows of a wider buffer
    q = qbuf[:, 2: 2 + hq * hd].view(n, hq, hd)
    k = rand(n, hk, hd, dtype=dtype, seed=hk + 10)
    pos = torch.arange(50, 50 + n, device=DEV)
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=DEV) / rot))
    half, tile = rot // 2, 64
    sdt = torch.float32 if fp32 else dtype
    s1, s2 = (torch.empty(tile, max(hq, hk), half, device=DEV, dtype=sdt) for _ in range(2))
    c, s = (torch.empty(tile, half, device=DEV) for _ in range(2))
    wq, wk = q.clone(), k.clone()
    R.rope_(wq, pos, inv, fp32, s1[:, :hq], s2[:, :hq], c, s)
    R.rope_(wk, pos, inv, fp32, s1[:, :hk], s2[:, :hk], c, s)
    tc, ts = (torch.empty(n, half, device=DEV) for _ in range(2))
    R.rope_cos_sin(tc, ts, pos, inv)
    for setting in ("torch", "triton"):
        gbuf, gk = qbuf.clone(), k.clone()
        gq = gbuf[:, 2: 2 + hq * hd].view(n, hq, hd)                      # strided, as a fused qkv's q
        E.rope_pair_(gq, gk, tc, ts, fp32, s1, s2, setting=setting)
        same(gq, wq)
        same(gk, wk)
        assert torch.equal(gbuf[:, :2], qbuf[:, :2])                     # neighbours untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp32", [True, False])
@pytest.mark.parametrize("hq, hk, hd, rot", [(4, 4, 8, 8), (6, 2, 16, 8), (3, 1, 12, 12)])
def test_qkv_rope_store_equals_copies_and_ropes(dtype, fp32, hq, hk, hd, rot):
    """A fused q|k|v output: q rotated in place, k rotated into the store rows (its unrotated tail
    dims copied), v copied; one launch = the copies then rope_pair_."""
    n = 21
    qkv0 = rand(n, (hq + 2 * hk) * hd, dtype=dtype, seed=hq + hk)
    store = rand(n + 4, 2, hk * hd, dtype=dtype, seed=99)                # [rows, K|V, kv_dim]: strided rows
    pos = torch.arange(30, 30 + n, device=DEV)
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=DEV) / rot))
    half, tile = rot // 2, 64
    sdt = torch.float32 if fp32 else dtype
    s1, s2 = (torch.empty(tile, max(hq, hk), half, device=DEV, dtype=sdt) for _ in range(2))
    tc, ts = (torch.empty(n, half, device=DEV) for _ in range(2))
    R.rope_cos_sin(tc, ts, pos, inv)
    results = []
    for setting in ("torch", "triton"):
        qkv, st = qkv0.clone(), store.clone()
        E.qkv_rope_store(qkv, st[2:2 + n, 0], st[2:2 + n, 1], tc, ts, hq, hk, hd, fp32, s1, s2, setting=setting)
        results.append((qkv, st))
    (wq, ws), (gq, gs) = results
    same(gq[:, :hq * hd], wq[:, :hq * hd])
    same(gs, ws)
    assert torch.equal(gs[:2], store[:2]) and torch.equal(gs[2 + n:], store[2 + n:])   # other rows untouched
    assert torch.equal(ws[2:2 + n, 1], qkv0[:, (hq + hk) * hd:])                        # v: a copy
