"""The batch-invariant matmul's tiles on the GPU (kernels/invariant_tiles.py): at LLaDA-8B's shapes
every row of a product is the same bits computed alone (M = 1), among M = 7 ... 2048 rows, and
under every tile of the table (the tile follows M, so a row's bits are M-independent only if all
tiles agree). A failure names the tile or the M that differs. Skipped without CUDA.

    python -m pytest -q -m gpu tests/gpu/test_invariant_gemm_gpu.py"""

import pytest
import torch
from conftest import needs_cuda

from mosaic.kernels import invariant_triton as T
from mosaic.kernels.invariant_tiles import all_tiles

pytestmark = [pytest.mark.gpu, needs_cuda]

ROWS = (1, 7, 32, 33, 64, 100, 512, 2048)
CASES = [(4096, 4096, torch.bfloat16), (4096, 2 * 12288, torch.bfloat16), (12288, 4096, torch.bfloat16),
         (4096, 126464, torch.bfloat16), (4096, 4096, torch.float32)]


def _difference(what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when equal bitwise, else which rows differ and by how much."""
    if torch.equal(got, want):
        return None
    rows = (got != want).any(-1).nonzero()[:, 0]
    diff = (got.float() - want.float()).abs().max().item()
    return f"{what}: {rows.numel()} of {got.shape[0]} rows differ (first {rows[0].item()}), max |diff| {diff:.3g}"


@pytest.mark.parametrize("k,n,dtype", CASES, ids=[f"{k}x{n}-{str(d)[6:]}" for k, n, d in CASES])
def test_a_rows_bits_are_the_same_alone_at_every_m_and_under_every_tile(k, n, dtype):
    g = torch.Generator(device="cuda").manual_seed(k + n)
    m = max(ROWS)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
    ref = torch.empty(m, n, device="cuda", dtype=dtype)
    T.matmul(ref, x, w)                                   # the M = 2048 call, its own tile
    problems = []
    out = torch.empty_like(ref)
    for t in all_tiles(dtype):                            # every tile the rule can pick
        T.matmul(out, x, w, tile=t)
        problems.append(_difference(f"tile {t.bm}x{t.bn}x{t.bk} w{t.warps} s{t.stages}", out, ref))
    for rows in ROWS:                                     # the rule's own pick at each M
        t = T.tile_for(x[:rows], n)
        T.matmul(out[:rows], x[:rows], w)
        problems.append(_difference(f"M = {rows} (tile {t.bm}x{t.bn})", out[:rows], ref[:rows]))
    for r in range(m):                                    # every row alone: M = 1
        T.matmul(out[r:r + 1], x[r:r + 1], w)
    problems.append(_difference("each row alone (M = 1)", out, ref))
    problems = [p for p in problems if p]
    assert not problems, f"{k} -> {n} {dtype}:\n" + "\n".join(problems)
    want = x[:64].float() @ w.float().t()
    assert torch.allclose(ref[:64].float(), want, rtol=2e-2, atol=5e-2 if dtype != torch.float32 else 1e-3)
