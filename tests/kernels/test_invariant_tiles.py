"""The batch-invariant matmul's tile rule (kernels/invariant_tiles.py): every tile it can pick
keeps an element's K loop (BK, one MMA family), small M fills the SMs, large M keeps the 128 x 128
tile; under TRITON_INTERPRET=1 every tile gives a row the same bits. The GPU check of the bits
is tests/gpu/test_invariant_gemm_gpu.py."""

import numpy as np
import pytest
import torch
from hopper_compile import run_for_hopper

from mosaic.kernels import interpret
from mosaic.kernels import invariant_tiles as IT

H200 = 132
LLADA = [(4096, 4096), (4096, 2 * 12288), (12288, 4096), (4096, 126464)]    # (K, N) of LLaDA-8B
ROWS = (1, 7, 32, 33, 64, 100, 128, 129, 256, 384, 512, 1152, 2048, 16384)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_tile_keeps_the_k_loop_and_the_mma_family(dtype):
    # one BK per dtype; BM a multiple of 64 and warps a multiple of 4: Triton's wgmma condition on
    # Hopper (mma.sync below it); operands in flight within the 227 KiB of shared memory
    for t in IT.all_tiles(dtype):
        assert t.bk == (32 if dtype == torch.float32 else 64)
        assert t.bm in (64, 128) and t.bn in (32, 64, 128)
        assert t.warps % 4 == 0 and t.bm % 64 == 0
        assert (t.bm + t.bn) * t.bk * dtype.itemsize * t.stages <= 227 * 1024


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_rule_picks_only_tiles_of_the_table(dtype):
    tiles = set(IT.all_tiles(dtype))
    for m in ROWS:
        for _, n in LLADA + [(32, 8), (4096, 64), (4096, 1000)]:
            for sms in (1, 78, 114, 132, 148):
                assert IT.tile(m, n, dtype, sms) in tiles, (m, n, sms)


def test_a_block_step_fills_the_sms():
    """M = 32 (a batch-1 block step): 128 x 128 gave 32 programs for N = 4096; every LLaDA shape
    now keeps >= FILL (70%) of the H200's SMs busy, and rows are tiled by 64."""
    for m in (1, 7, 32, 64):
        for _, n in LLADA:
            t = IT.tile(m, n, torch.bfloat16, H200)
            assert t.bm == 64
            assert IT.fill(IT.programs(m, n, t.bm, t.bn), H200) >= IT.FILL, (m, n, t)
    assert (IT.tile(32, 4096, torch.bfloat16, H200).bn, IT.tile(32, 24576, torch.bfloat16, H200).bn,
            IT.tile(32, 126464, torch.bfloat16, H200).bn) == (32, 128, 128)


def test_large_m_keeps_the_big_tile():
    """Batch 16 (M = 512 block rows) and every fill of a 1k prompt run today's 128 x 128 x 64."""
    for m in (512, 1152, 2048, 16384):
        for _, n in LLADA:
            t = IT.tile(m, n, torch.bfloat16, H200)
            assert (t.bm, t.bn, t.bk, t.warps, t.stages) == (128, 128, 64, 8, 3), (m, n)
    assert IT.tile(256, 4096, torch.bfloat16, H200) == IT.make(128, 64, torch.bfloat16)   # 64 -> 128 programs


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        IT.tile(0, 4096, torch.bfloat16, H200)


def _numpy_dot_is_place_invariant() -> bool:
    """The interpreter's tl.dot is numpy's product (OpenBLAS): where the same rows multiplied in
    blocks of other shapes round differently, the interpreter cannot show the kernel's bits."""
    g = np.random.default_rng(0)
    a, b = g.standard_normal((64, 16), np.float32), g.standard_normal((16, 64), np.float32)
    return np.array_equal(a[:16] @ b[:, :16], (a @ b)[:16, :16]) and np.array_equal(a[5:6] @ b, (a @ b)[5:6])


@pytest.mark.skipif(not interpret(), reason="the interpreter's check (the GPU's: tests/gpu)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_every_tile_gives_the_same_bits_under_the_interpreter(dtype, bias):
    """The kernel's indexing, masks and grouped order under every tile of the table (and the
    interpreter's): the same K loop, so the same bits for every row, and the reference's values."""
    if not _numpy_dot_is_place_invariant():
        pytest.skip("numpy's product here rounds a row differently by the block's shape")
    from mosaic.kernels import invariant_triton as T
    g = torch.Generator().manual_seed(0)
    m, d, o = 70, 40, 72                     # 70 rows: two 64-row tiles, the second ragged
    x, w = torch.randn(m, d, generator=g).to(dtype), torch.randn(o, d, generator=g).to(dtype)
    b = torch.randn(o, generator=g).to(dtype) if bias else None
    small = [IT.Tile(t.bm, t.bn, 16, t.warps, 1) for t in IT.all_tiles(dtype)]   # BK 16: K = 40 ragged
    outs = {}
    for t in [IT.INTERPRET, *small]:
        outs[t] = torch.empty(m, o, dtype=dtype)
        T.matmul(outs[t], x, w, b, tile=t)
    alone = torch.empty(1, o, dtype=dtype)
    T.matmul(alone, x[69:], w, b, tile=small[-1])
    differ = [(t.bm, t.bn) for t, out in outs.items() if not torch.equal(out, outs[IT.INTERPRET])]
    assert not differ and torch.equal(alone[0], outs[IT.INTERPRET][69]), differ
    ref = x.float() @ w.float().t() + (b.float() if bias else 0)
    assert torch.allclose(outs[IT.INTERPRET].float(), ref, rtol=1e-2, atol=1e-2 if dtype == torch.float16 else 1e-5)


@pytest.mark.slow
def test_every_tile_compiles_to_one_mma_family_for_hopper():
    """tools/gemm_compile_check.py: each tile lowered to sm_90a by Triton and ptxas, no GPU: 16-bit
    tiles are wgmma k16 alone (no mma.sync), fp32 FMAs, no spills, shared memory within 227 KiB."""
    r = run_for_hopper(["tools/gemm_compile_check.py"])
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert r.stdout.count("ok ") == 2 * len(IT.TILES), r.stdout
