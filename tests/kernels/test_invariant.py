"""Batch-invariant ops: row r's result is bitwise the same whatever rows surround it and however
many there are (the PyTorch paths on the CPU; the Triton kernels under TRITON_INTERPRET=1 or on
CUDA), and each equals the default op up to rounding."""

import pytest
import torch

from mosaic.kernels import interpret
from mosaic.kernels import invariant as INV
from mosaic.kernels import reference as R
from mosaic.kernels.masked_logits import INVARIANT_SPLITS, FusedSpec, fused_reduce, workspace_rows
from mosaic.kernels.masked_logits_ref import reduce_reference

triton_only = pytest.mark.skipif(not (interpret() or torch.cuda.is_available()),
                                 reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() and not interpret() else "cpu"


def surrounded(row: torch.Tensor, n: int, at: int, g) -> torch.Tensor:
    """n random rows with `row` at index `at`."""
    x = torch.randn(n, row.shape[0], generator=g).to(row.dtype)
    x[at] = row
    return x


def results_of_one_row(fn, row, sizes, g, tile: int | None = None):
    """fn's row for `row` placed first, in the middle and last of batches of each size; with
    `tile`, only at the same place within a tile of that many rows (the interpreter's tl.dot is
    numpy's OpenBLAS product, which is not even invariant to a row's place in a fixed 16 x 16
    tile; a GPU's MMA treats every place alike)."""
    outs = []
    for n in sizes:
        places = {0, n // 2, n - 1} if tile is None else set(range(1, n, tile))
        for at in places:
            outs.append(fn(surrounded(row, n, at, g))[at])
    return outs


TILE = 16 if interpret() else None   # the Triton kernels' row tile under the interpreter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_tiles_make_a_row_independent_of_its_batch(dtype, bias):
    g = torch.Generator().manual_seed(0)
    d, o = 48, 40
    w = torch.randn(o, d, generator=g).to(dtype)
    b = torch.randn(o, generator=g).to(dtype) if bias else None
    row = torch.randn(d, generator=g).to(dtype)

    def tiled(x):
        out = torch.empty(x.shape[0], o, dtype=dtype)
        INV.linear(out, x, w, b, setting="torch")
        return out
    outs = results_of_one_row(tiled, row, (1, 2, 3, 5, 9, 11, 17, 25, 64, 65, 130), g)
    assert all(torch.equal(outs[0], t) for t in outs)
    ref = torch.empty(1, o, dtype=dtype)
    R.linear(ref, row[None], w, b)
    assert torch.allclose(outs[0].float(), ref[0].float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)


def test_the_default_product_is_not_row_invariant_here():
    """What the tiles are for: MKL's product of a few rows rounds differently from the same rows
    in a larger one (measured with 2 threads: 1-3, 5-7 and 9-11 rows). Skipped where this
    machine's library happens to be invariant at these sizes."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(40, 48, generator=g), torch.randn(64, 48, generator=g)
    full = torch.mm(x, w.t())
    differs = [m for m in range(1, 12) if not torch.equal(torch.mm(x[:m], w.t()), full[:m])]
    if not differs:
        pytest.skip("this BLAS is row-invariant at these sizes")
    assert differs


def test_cpu_attention_tiles_make_a_query_row_independent_of_the_chunk():
    g = torch.Generator().manual_seed(1)
    hq, hkv, hd, nk = 4, 2, 8, 37
    k, v = torch.randn(nk, hkv, hd, generator=g), torch.randn(nk, hkv, hd, generator=g)
    row = torch.randn(hq * hd, generator=g)

    def att(qflat):
        q = qflat.view(-1, hq, hd)
        out = torch.empty(q.shape[0], hq * hd)
        INV.attention_tiles(out, q, k, v)
        return out
    outs = results_of_one_row(att, row, (1, 3, 7, 64, 70), g)
    assert all(torch.equal(outs[0], t) for t in outs)
    ref = torch.empty(1, hq * hd)
    R.attention(ref, row.view(1, hq, hd), k, v)
    assert torch.allclose(outs[0], ref[0], atol=1e-5)


def test_row_mean_is_the_mean():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(13, 37, generator=g).to(DEV)
    out = torch.empty(13, 1, device=DEV)
    INV.row_mean(out, x)
    assert torch.allclose(out, x.mean(-1, keepdim=True), atol=1e-6)


@triton_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_triton_matmul_is_row_invariant_and_right(dtype, bias):
    from mosaic.kernels import invariant_triton as T
    g = torch.Generator().manual_seed(3)
    d, o = 40, 24
    w = torch.randn(o, d, generator=g).to(dtype).to(DEV)
    b = torch.randn(o, generator=g).to(dtype).to(DEV) if bias else None
    row = torch.randn(d, generator=g).to(dtype)

    def mm(x):
        x = x.to(DEV)
        out = torch.empty(x.shape[0], o, dtype=dtype, device=DEV)
        T.matmul(out, x, w, b)
        return out
    outs = results_of_one_row(mm, row, (2, 5, 17, 33, 50), g, TILE)
    assert all(torch.equal(outs[0], t) for t in outs)
    ref = row.to(DEV).float() @ w.float().t() + (b.float() if bias else 0)
    assert torch.allclose(outs[0].float(), ref, rtol=1e-2, atol=1e-2 if dtype == torch.float16 else 1e-5)


@triton_only
def test_triton_row_mean_is_row_invariant():
    from mosaic.kernels import invariant_triton as T
    g = torch.Generator().manual_seed(4)
    row = torch.randn(50, generator=g)

    def mean(x):
        x = x.to(DEV)
        out = torch.empty(x.shape[0], 1, device=DEV)
        T.row_mean(out, x)
        return out[:, 0]
    outs = results_of_one_row(mean, row, (1, 6, 20), g)
    assert all(torch.equal(outs[0], t) for t in outs)
    assert torch.allclose(outs[0], row.mean().to(DEV), atol=1e-6)


@triton_only
@pytest.mark.parametrize("kind", ["prob", "margin", "entropy"])
def test_fused_logits_with_fixed_splits_are_row_invariant(kind):
    """The default split count follows M (num_splits(m)); the invariant mode's does not, and
    combines the splits in split order: a row's confidence is the same bits at any M."""
    spec = {"prob": FusedSpec(), "margin": FusedSpec(want_prob=False, want_margin=True),
            "entropy": FusedSpec(want_prob=False, want_entropy=True)}[kind]
    g = torch.Generator().manual_seed(5)
    d, V = 16, 300
    w = (torch.randn(V, d, generator=g) / d**0.5).to(DEV)
    x = torch.randn(40, d, generator=g).to(DEV)
    got = {}
    for m in (1, 7, 40):
        rows = torch.cat([torch.tensor([3]), torch.randperm(40, generator=g)[: m - 1]]).to(DEV)
        outs = {"x0": torch.empty(m, dtype=torch.long, device=DEV), "conf": torch.empty(m, device=DEV)}
        ws = torch.full((workspace_rows(m, True), 8), float("nan"), device=DEV)
        fused_reduce(x, rows, w, spec, outs, ws, invariant=True)
        got[m] = (int(outs["x0"][0]), outs["conf"][0].clone())
    assert len({v[0] for v in got.values()}) == 1
    assert all(torch.equal(got[1][1], v[1]) for v in got.values())
    ref = reduce_reference(x, torch.tensor([3], device=DEV), w, spec)
    assert got[1][0] == int(ref["x0"][0])
    assert torch.allclose(got[1][1], ref["conf"][0], rtol=1e-5, atol=1e-5)
    assert workspace_rows(40, True) == INVARIANT_SPLITS * 40


@pytest.mark.parametrize("width", [8, 16, 24, 48, 100])
def test_cpu_pointwise_ops_give_a_row_the_same_bits_whatever_the_row_count(width):
    # PyTorch's vectorised CPU loops finish with a scalar tail whose libm result can differ from
    # the SIMD lane's (AVX-512: silu over [c, 16] differed for 28 of 66 rows); the invariant ops
    # put every element in the same lane whatever the row count
    g = torch.Generator().manual_seed(width)
    x, y = torch.randn(13, width, generator=g) * 4, torch.randn(13, width, generator=g)
    freq = torch.rand(width, generator=g)
    for c in range(1, 14):
        a, b = x[:c].clone(), y[:c].clone()
        INV.silu_mul_(a, b)
        sig = INV.sigmoid(x[:c])
        cos, sin = torch.empty(c, width), torch.empty(c, width)
        INV.rope_cos_sin(cos, sin, torch.arange(c) * 977, freq)
        for r in range(c):
            a1, b1 = x[r:r + 1].clone(), y[r:r + 1].clone()
            INV.silu_mul_(a1, b1)
            assert torch.equal(a1[0], a[r]), (c, r)
            assert torch.equal(INV.sigmoid(x[r:r + 1])[0], sig[r])
            c1, s1 = torch.empty(1, width), torch.empty(1, width)
            INV.rope_cos_sin(c1, s1, torch.tensor([r * 977]), freq)
            assert torch.equal(c1[0], cos[r]) and torch.equal(s1[0], sin[r])
