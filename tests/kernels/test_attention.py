"""The attention kernel under TRITON_INTERPRET=1 (CPU) against its PyTorch oracle and against a
plain softmax written here (so the oracle is checked too). Tiny shapes: the interpreter runs
~15 ms per key tile of 16."""

import math

import pytest
import torch

from mosaic.kernels import interpret
from mosaic.kernels import reference as R
from mosaic.kernels.attention import attention_flops, attention_into, num_splits, workspace_bytes
from mosaic.kernels.attention_layout import BlockLayout, layout_from_mask, random_layout
from mosaic.kernels.attention_ref import attention_ref, pooled_block_scores

pytestmark = pytest.mark.skipif(not (interpret() or torch.cuda.is_available()),
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() and not interpret() else "cpu"
INF = float("inf")


def qkv(nq, nk, hq, hkv, hd, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, hd, generator=g) for n, h in ((nq, hq), (nk, hkv), (nk, hkv)))
    return q.to(DEV, dtype), k.to(DEV, dtype), v.to(DEV, dtype)


def plain(q, k, v, allowed=None):
    """softmax(q k^T / sqrt(hd)) v in fp32 with K/V expanded; allowed [Hq, nq, Nk] bool."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) / math.sqrt(q.shape[2])
    if allowed is not None:
        s = s.masked_fill(~allowed, -INF)
    lse = s.logsumexp(-1)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]))
    return torch.einsum("hqk,khd->qhd", p, vv).reshape(q.shape[0], -1), lse


def run(q, k, v, **kw):
    out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), float("nan"), dtype=q.dtype, device=DEV)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device=DEV)
    attention_into(out, q, k, v, lse=lse, impl="triton", **kw)
    return out, lse


def close(got, want, tol=1e-5):
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), (got.float() - want.float()).abs().max()


@pytest.mark.parametrize("nq, nk, hq, hkv, hd", [(1, 1, 1, 1, 8), (37, 53, 4, 4, 8), (19, 70, 4, 2, 16),
                                                 (23, 41, 7, 1, 32), (17, 33, 2, 1, 64)])
def test_dense_matches_plain_softmax(nq, nk, hq, hkv, hd):
    q, k, v = qkv(nq, nk, hq, hkv, hd, seed=nq)
    out, lse = run(q, k, v)
    want, want_lse = plain(q, k, v)
    close(out, want)
    close(lse, want_lse)
    ref_out, ref_lse = torch.empty_like(out), torch.empty_like(lse)
    attention_ref(ref_out, q, k, v, lse=ref_lse, tile_elems=7 * nk)   # several row tiles
    close(ref_out, want)
    close(ref_lse, want_lse)


def test_strided_views_of_planned_buffers():
    nq, nk, hq, hkv, hd = 21, 30, 4, 2, 16
    q0, k0, v0 = qkv(nq + nk, nk, hq, hkv, hd, seed=1)
    qkv_rows = torch.cat([q0[:nk].reshape(nk, -1), k0.reshape(nk, -1), v0.reshape(nk, -1)], 1)  # fused rows
    q = qkv_rows[:nq, : hq * hd].view(nq, hq, hd)                 # row stride (hq + 2 hkv) * hd
    k = qkv_rows[:, hq * hd: (hq + hkv) * hd].view(nk, hkv, hd)
    v = qkv_rows[:, (hq + hkv) * hd:].view(nk, hkv, hd)
    wide = torch.full((nq, hq * hd + 24), 7.0, device=DEV)
    out = wide[:, 8: 8 + hq * hd]                                  # a column window of a wider buffer
    lse_buf = torch.full((hq, nq + 5), 7.0, device=DEV)
    attention_into(out, q, k, v, lse=lse_buf[:, :nq], impl="triton")
    want, want_lse = plain(q, k, v)
    close(out, want)
    close(lse_buf[:, :nq], want_lse)
    assert (wide[:, :8] == 7).all() and (wide[:, 8 + hq * hd:] == 7).all() and (lse_buf[:, nq:] == 7).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    q, k, v = qkv(29, 45, 4, 2, 32, seed=3, dtype=dtype)
    out, lse = run(q, k, v)
    want, want_lse = plain(q, k, v)          # fp32 on the same rounded inputs
    assert out.dtype == dtype
    close(out, want, 2e-2)
    close(lse, want_lse, 1e-3)


@pytest.mark.parametrize("splits", [2, 3, 7])    # 7 > the 4 key tiles: some splits are empty
def test_split_k_equals_one_pass(splits):
    q, k, v = qkv(20, 61, 4, 2, 16, seed=4)
    ws = torch.empty(splits * 4 * 20 * 17 * 4, dtype=torch.uint8, device=DEV)  # bytes, as a plan gives
    out, lse = run(q, k, v, splits=splits, workspace=ws)
    want, want_lse = plain(q, k, v)
    close(out, want)
    close(lse, want_lse)


def test_merge_of_key_halves_equals_the_whole():
    q, k, v = qkv(18, 50, 4, 2, 16, seed=5)
    o1, l1 = run(q, k[:21], v[:21])
    o2, l2 = run(q, k[21:], v[21:], splits=2)
    acc = o1.view(18, 4, 16).float().clone()
    R.merge_partial(acc, l1.clone(), o2.view(18, 4, 16).float(), l2)
    want, _ = plain(q, k, v)
    close(acc.reshape(18, -1), want)


def test_key_start_is_slicing_and_no_keys_give_zero():
    q, k, v = qkv(9, 40, 2, 2, 8, seed=6)
    out, lse = run(q, k, v, key_start=13)
    want, want_lse = plain(q, k[13:], v[13:])
    close(out, want)
    close(lse, want_lse)
    out, lse = run(q, k, v, key_start=40)
    assert (out == 0).all() and (lse == -INF).all()


def test_out_over_q_is_refused():
    """Writing over q's own rows gave wrong results on the H200 (a program's output tile can be
    written before another head's program read its q tile), so it is refused up front."""
    q, k, v = qkv(19, 30, 4, 2, 8, seed=14)
    buf = q.reshape(19, 32).clone()
    with pytest.raises(ValueError, match="must not overlap q"):
        attention_into(buf, buf.view(19, 4, 8), k, v, impl="triton")


def element_mask(layout: BlockLayout, nq, nk, hq):
    """[Hq, nq, Nk] bool from the layout, built independently of attention_ref."""
    bm = layout.block_mask()
    if layout.heads_per_layout == "kv":
        bm = bm.repeat_interleave(hq // bm.shape[0], 0)
    qb = torch.arange(nq, device=bm.device) // layout.block_q
    kb = torch.arange(nk, device=bm.device) // layout.block_k
    return bm[:, qb][:, :, kb]


@pytest.mark.parametrize("heads, bq, bk, density, splits", [("q", 16, 16, 0.5, None), ("kv", 32, 32, 0.4, None),
                                                            ("q", 16, 32, 0.3, 3), ("kv", 32, 16, 0.6, 2)])
def test_block_sparse_layouts(heads, bq, bk, density, splits):
    nq, nk, hq, hkv, hd = 45, 83, 4, 2, 16
    q, k, v = qkv(nq, nk, hq, hkv, hd, seed=7)
    h = hq if heads == "q" else hkv
    lay = random_layout(h, nq, nk, bq, bk, density, heads, diagonal=False, seed=bq + bk, device=DEV)
    out, lse = run(q, k, v, layout=lay, splits=splits)
    want, want_lse = plain(q, k, v, element_mask(lay, nq, nk, hq))
    close(out, want)
    close(lse, want_lse)
    ref_out, ref_lse = torch.empty_like(out), torch.empty_like(lse)
    attention_ref(ref_out, q, k, v, lse=ref_lse, layout=lay)
    close(ref_out, want)
    close(ref_lse, want_lse)


def test_layout_block_past_the_keys_by_several_kernel_tiles():
    nq, nk = 20, 70                      # key block 1 of 64 holds keys 64-69: one partial tile of 16, three past
    q, k, v = qkv(nq, nk, 2, 1, 8, seed=13)
    lay = layout_from_mask(torch.tensor([[[True, True]], [[False, True]]], device=DEV), 64, 64, "q")
    for splits in (None, 2):
        out, lse = run(q, k, v, layout=lay, splits=splits)
        want, want_lse = plain(q, k, v, element_mask(lay, nq, nk, 2))
        close(out, want)
        close(lse, want_lse)


def test_empty_layout_rows_give_zero_and_minus_inf():
    nq, nk, hq, hd = 40, 50, 2, 8
    q, k, v = qkv(nq, nk, hq, 1, hd, seed=8)
    mask = torch.zeros(hq, 3, 4, dtype=torch.bool)
    mask[0, 0, [1, 3]] = True            # head 0: first block reads keys 16-31 and 48-49 (partial)
    mask[1, 2, 0] = True                 # head 1: only the last (partial) query block reads anything
    lay = layout_from_mask(mask.to(DEV), 16, 16, "q")
    for splits in (None, 3):
        out, lse = run(q, k, v, layout=lay, splits=splits)
        want, want_lse = plain(q, k, v, element_mask(lay, nq, nk, hq))
        close(out, want)
        assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
        assert (out.view(nq, hq, hd)[16:, 0] == 0).all() and (lse[0, 16:] == -INF).all()
        assert (out.view(nq, hq, hd)[:32, 1] == 0).all() and (lse[1, :32] == -INF).all()


def test_full_layout_equals_dense_and_density():
    nq, nk = 33, 47
    q, k, v = qkv(nq, nk, 2, 2, 8, seed=9)
    lay = layout_from_mask(torch.ones(2, 3, 3, dtype=torch.bool, device=DEV), 16, 16, "kv")
    assert lay.density() == 1.0 and lay.nnz == 18
    close(run(q, k, v, layout=lay)[0], run(q, k, v)[0])


def test_layout_round_trip_and_checks():
    mask = torch.rand(3, 5, 7, generator=torch.Generator().manual_seed(0)) < 0.3
    mask[1, 2] = False
    lay = layout_from_mask(mask, 32, 64, "q")
    assert torch.equal(lay.block_mask(), mask)
    assert lay.density() == pytest.approx(mask.float().mean().item())
    assert lay.indptr[1, 2] == lay.indptr[1, 3]                    # an empty row
    lay.check(nq=150, nk=400, hq=3, hkv=1)
    with pytest.raises(ValueError):
        lay.check(nq=200, nk=400, hq=3, hkv=1)                     # 7 query blocks, not 5
    with pytest.raises(ValueError):
        lay.check(nq=150, nk=500, hq=3, hkv=1)                     # 8 key blocks, not 7


def test_torch_path_is_the_oracle():
    q, k, v = qkv(11, 20, 4, 2, 8, seed=10)
    out, lse = torch.empty(11, 32, device=DEV), torch.empty(4, 11, device=DEV)
    attention_into(out, q, k, v, lse=lse, impl="torch")
    want, want_lse = plain(q, k, v)
    close(out, want)
    close(lse, want_lse)


def test_tma_descriptors_match_pointer_loads():
    from mosaic.kernels.attention_triton import tma_failures
    q, k, v = qkv(20, 37, 4, 2, 16, seed=11)
    close(run(q, k, v, tma=True)[0], run(q, k, v, tma=False)[0])
    assert not tma_failures


def test_bad_inputs_raise():
    q, k, v = qkv(4, 5, 3, 2, 8)
    with pytest.raises(ValueError):
        attention_into(torch.empty(4, 24), q, k, v)                  # 3 heads do not group over 2
    q, k, v = qkv(4, 5, 2, 1, 8)
    with pytest.raises(ValueError):
        attention_into(torch.empty(4, 16), q, k, v.double())
    with pytest.raises(ValueError):
        attention_into(torch.empty(4, 16), q, k, v, lse=torch.empty(4, 2))


def test_pooled_block_scores():
    q, k, _ = qkv(37, 50, 4, 2, 8, seed=12)
    got = pooled_block_scores(q, k, 16, 32)
    qm = torch.stack([q[i: i + 16].float().mean(0) for i in range(0, 37, 16)])    # [3, Hq, hd]
    km = torch.stack([k[j: j + 32].float().mean(0) for j in range(0, 50, 32)])    # [2, Hkv, hd]
    want = torch.einsum("ihd,jhd->hij", qm, km.repeat_interleave(2, 1)) / math.sqrt(8)
    assert got.shape == (4, 3, 2)
    close(got, want)


def test_splits_and_workspace_are_pure_and_monotone():
    assert num_splits(32768, 32, 32768) == 1                      # 8192 programs: no split
    assert num_splits(400, 32, 180_000) == 1                      # 128 programs: one 97%-full wave
    assert num_splits(128, 32, 180_000) == 4
    assert num_splits(128, 32, 1000) == 1                         # too few keys to split
    sizes = [workspace_bytes(n, 28, 128, 180_000) for n in range(1, 3000, 37)]
    assert sizes == sorted(sizes) and max(sizes) <= 4 * 1056 * 128 * 129
    assert workspace_bytes(40000, 32, 128, 40000) == workspace_bytes(35000, 32, 128, 40000)
    assert attention_flops(32768, 32768, 32, 128) == 4 * 32768**2 * 128 * 32


def test_no_retune_key_is_constants_only():
    from mosaic.kernels.attention_triton import _tuned
    assert set(_tuned.keys) == {"HEAD_DIM", "G", "LAYOUT_BQ", "LAYOUT_BK", "TMA", "WS"}


@pytest.mark.slow
def test_kernel_compiles_for_hopper_without_a_gpu():
    """tools/attention_compile_check.py --quick: the dense and sparse+TMA kernels lowered to sm_90a
    by Triton's own compiler and ptxas (catches GPU-only lowering errors the interpreter cannot)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin").is_dir():
        pytest.skip("this Triton has no bundled NVIDIA toolchain")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "tools" / "attention_compile_check.py"), "--quick"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert r.stdout.count(" ok ") == 2 and "wgmma True" in r.stdout, r.stdout
