"""The routed experts' kernels (kernels/moe.py, moe_triton.py) against the per-expert loop, the
host-sync detector (meta tensors: no data, so any read of a value on the host raises) and the
one chooser (kernels.moe_kernel)."""

import pytest
import torch

from mosaic import kernels
from mosaic.errors import InputError
from mosaic.kernels import moe as MK
from mosaic.kernels import reference as R

# E, k, F, d, n (bf16 rows of whole 16 bytes: grouped_mm's requirement; F = 12 in fp32 covers a
# width that is no multiple of the CPU's vector)
DEV = "cuda" if torch.cuda.is_available() and not kernels.interpret() else "cpu"   # Triton's device
SHAPES = [(8, 3, 12, 32, 5), (16, 4, 16, 24, 1), (64, 8, 32, 16, 37), (4, 2, 8, 8, 0)]


def _case(E, k, F, d, n, dtype, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(dtype)
    w = [torch.randn(E, F, d, generator=g).to(dtype) / d ** 0.5, torch.randn(E, F, d, generator=g).to(dtype) / d ** 0.5,
         torch.randn(E, d, F, generator=g).to(dtype) / F ** 0.5]
    scores = torch.rand(n, E, generator=g)
    if skew:   # most rows on a few experts, most experts empty
        scores[:, : E // 2] -= 2
    top_i = scores.topk(k, dim=-1)[1]
    return h, w, top_i


def _silu_mul(g, u):
    R.silu_mul_(g, u)


def _run(path, h, w, top_i, lo=0, held=None, E=None):
    n, k = top_i.shape
    d, F = h.shape[1], w[0].shape[1]
    rows = n * k
    slots = torch.full((rows, d), float("nan"), dtype=h.dtype, device=h.device)
    order, offs = MK.sort_by_expert(top_i, lo, held, E or w[0].shape[0])
    if path == "loop":
        MK.experts_loop(slots, h, order, offs, k, *w, torch.empty(n, d, dtype=h.dtype),
                        torch.empty(n, F, dtype=h.dtype), torch.empty(n, F, dtype=h.dtype), R.linear, _silu_mul)
    elif path == "grouped":
        MK.experts_grouped(slots, h, order, offs, k, *w, torch.empty(rows, d, dtype=h.dtype), _silu_mul)
    else:
        nb = MK.num_blocks(rows, w[0].shape[0], MK.tiles(rows, w[0].shape[0], h.dtype)[0])
        MK.experts_triton(slots, h, order, offs, k, *w, torch.empty(rows, F, dtype=h.dtype, device=h.device),
                   torch.empty(3, nb, dtype=torch.int32, device=h.device))
    return slots


def _plain(h, w, top_i):
    """The published loop's products, row by row: slot (t, j) = expert top_i[t, j](h[t])."""
    n, k = top_i.shape
    out = torch.empty(n * k, h.shape[1], dtype=h.dtype)
    for t in range(n):
        for j in range(k):
            e = int(top_i[t, j])
            g = h[t:t + 1] @ w[0][e].t()
            u = h[t:t + 1] @ w[1][e].t()
            out[t * k + j] = (torch.nn.functional.silu(g) * u) @ w[2][e].t()
    return out


def test_sort_by_expert_is_argsort_and_cumulative_counts():
    top_i = torch.tensor([[3, 0], [1, 3], [0, 2], [3, 1]])
    order, offs = MK.sort_by_expert(top_i, num_experts=5)
    flat = top_i.reshape(-1)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert offs.dtype == torch.int32
    assert offs.tolist() == torch.bincount(flat, minlength=5).cumsum(0).tolist() == [2, 4, 5, 8, 8]
    # a rank holding experts [1, 3): the others' rows after offs[-1], ties in (row, slot) order
    order, offs = MK.sort_by_expert(top_i, lo=1, held=2, num_experts=5)
    assert offs.tolist() == [2, 3]
    assert order[:3].tolist() == [2, 7, 5] and sorted(order[3:].tolist()) == [0, 1, 3, 4, 6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_grouped_gives_the_loops_bits(shape, dtype):
    E, k, F, d, n = shape
    if dtype == torch.bfloat16 and F % 8:
        F = 16
    h, w, top_i = _case(E, k, F, d, n, dtype, skew=E > 8)
    loop = _run("loop", h, w, top_i)
    assert torch.equal(_run("grouped", h, w, top_i), loop)
    if dtype == torch.float32 and n:
        torch.testing.assert_close(loop, _plain(h, w, top_i), rtol=1e-5, atol=1e-6)


def test_grouped_under_tensor_parallelism_writes_the_held_experts_only():
    h, w, top_i = _case(8, 3, 12, 32, 9, torch.float32)
    full = _run("loop", h, w, top_i)
    lo, held = 4, 4
    part = [t[lo:lo + held].contiguous() for t in w]
    mine = ((top_i >= lo) & (top_i < lo + held)).reshape(-1)
    for path in ("loop", "grouped"):
        got = _run(path, h, part, top_i, lo, held, E=8)
        assert torch.equal(got[mine], full[mine]), path


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_triton_kernel_matches_the_loop_in_value(shape):
    pytest.importorskip("triton")
    if not (torch.cuda.is_available() or kernels.interpret()):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    E, k, F, d, n = shape
    h, w, top_i = _case(E, k, F, d, n, torch.float32, skew=True)
    ref = _run("loop", h, w, top_i)
    h, w, top_i = h.to(DEV), [t.to(DEV) for t in w], top_i.to(DEV)
    torch.testing.assert_close(_run("triton", h, w, top_i).cpu(), ref, rtol=1e-4, atol=1e-5)


def test_triton_block_table_never_straddles_experts():
    pytest.importorskip("triton")
    from mosaic.kernels import moe_triton as MT
    offs = torch.tensor([0, 5, 5, 21, 22], dtype=torch.int32)       # counts 0, 5, 0, 16, 1
    nb = MK.num_blocks(22, 5, 4)
    table = torch.empty(3, nb, dtype=torch.int32)
    MT.block_table(table, offs, 4)
    # (expert, first row, its expert's end row): a block runs rows [first, min(first + bm, end))
    live = [(int(e), int(a), min(int(a) + 4, int(b))) for e, a, b in table.t() if a < b]
    assert live == [(1, 0, 4), (1, 4, 5), (3, 5, 9), (3, 9, 13), (3, 13, 17), (3, 17, 21), (4, 21, 22)]
    assert all(int(a) == int(b) == 0 for _, a, b in table.t()[len(live):])


def _meta(path):
    E, k, F, d, n = 8, 2, 16, 32, 6     # widths multiples of 8: grouped_mm's (CUTLASS's) alignment
    bf = torch.bfloat16
    h = torch.empty(n, d, dtype=bf, device="meta")
    w = [torch.empty(E, F, d, dtype=bf, device="meta"), torch.empty(E, F, d, dtype=bf, device="meta"),
         torch.empty(E, d, F, dtype=bf, device="meta")]
    top_i = torch.empty(n, k, dtype=torch.long, device="meta")
    slots = torch.empty(n * k, d, dtype=bf, device="meta")
    order, offs = MK.sort_by_expert(top_i, num_experts=E)
    if path == "grouped":
        MK.experts_grouped(slots, h, order, offs, k, *w, torch.empty(n * k, d, dtype=bf, device="meta"),
                           lambda g, u: g.mul_(u))
    else:
        MK.experts_loop(slots, h, order, offs, k, *w, torch.empty(n, d, dtype=bf, device="meta"),
                        torch.empty(n, F, dtype=bf, device="meta"), torch.empty(n, F, dtype=bf, device="meta"),
                        R.linear, lambda g, u: g.mul_(u))
    return slots


def test_grouped_path_reads_nothing_on_the_host():
    """On meta tensors every op that needs a value (item, tolist, bincount, nonzero, boolean
    indexing, repeat_interleave without output_size) raises: the grouped path runs, the loop
    (which reads its group sizes) does not, so the detector can fail."""
    assert _meta("grouped").shape == (12, 32)
    with pytest.raises((NotImplementedError, RuntimeError)):
        _meta("loop")


def test_chooser(monkeypatch):
    monkeypatch.setenv("MOSAIC_MOE_KERNEL", "loop")     # no longer read: the engine option is the switch
    bf, f32 = torch.bfloat16, torch.float32
    assert kernels.moe_kernel("cpu", f32) == "grouped"
    assert kernels.moe_kernel("cpu", f32, invariant=True) == "loop"     # fixed-tile products
    assert kernels.moe_kernel("cpu", f32, "loop") == "loop"
    assert kernels.moe_kernel("meta", f32) == "loop"                    # grouped_mm would sync on CUDA
    assert kernels.moe_kernel("meta", torch.float16, widths=(2048, 512)) == "loop"
    if not torch.cuda.is_available():
        assert kernels.moe_kernel("cuda", bf, widths=(2048, 512)) == "grouped"
        assert kernels.moe_kernel("cuda", bf, widths=(32, 12)) == "loop"   # rows not 16-byte aligned
        with pytest.raises(InputError, match="host sync"):
            kernels.moe_kernel("cuda", f32, "grouped")
    assert kernels.moe_kernel("cpu", f32, "grouped") == "grouped"
    with pytest.raises(InputError, match="moe_kernel='fast'"):
        kernels.moe_kernel("cpu", f32, "fast")


@pytest.mark.parametrize("dtype, fp32", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False),
                                         (torch.float16, False)])
@pytest.mark.parametrize("held", [False, True])
def test_combine_kernel_gives_the_references_bits(dtype, fp32, held):
    pytest.importorskip("triton")
    if not (torch.cuda.is_available() or kernels.interpret()):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    if fp32 and held:
        pytest.skip("the fp32 combine (LLaDA2) has no tensor parallelism")
    from mosaic.kernels import moe_combine_triton as T
    g = torch.Generator().manual_seed(7)
    n, k, d = 19, 8, 40
    slots = torch.randn(n * k, d, generator=g).to(dtype)
    w = torch.rand(n, k, generator=g)
    w = w if fp32 else w.to(dtype)
    mask = torch.rand(n, k, generator=g) > 0.4 if held else None
    if mask is not None:
        slots.view(n, k, d)[~mask] = float("nan")          # another rank's slots: unspecified
    slots, w = slots.to(DEV), w.to(DEV)
    mask = mask.to(DEV) if mask is not None else None
    ref, got = torch.empty(n, d, dtype=dtype, device=DEV), torch.empty(n, d, dtype=dtype, device=DEV)
    if fp32:
        MK.combine_f32(ref, slots, w, torch.empty(n, d, device=DEV))
    else:
        MK.combine_model_dtype(ref, slots, w, mask)
    T.combine(got, slots, w, fp32, mask)
    if DEV == "cpu" and dtype == torch.bfloat16:   # the interpreter casts to bf16 by truncation, k times
        torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -4, atol=k * 2 ** -5)
    else:                                          # the GPU rounds to nearest even, as PyTorch
        assert torch.equal(got, ref)


def test_grouped_tiles_cut_experts_without_changing_values():
    """Tiles of sorted rows (bounded grouped-GEMM outputs): experts cut by a tile boundary, the
    values of one call; on meta tensors the tiled path reads nothing on the host either."""
    h, w, top_i = _case(8, 3, 16, 32, 23, torch.float32)
    n, k = top_i.shape
    ref = _run("grouped", h, w, top_i)
    order, offs = MK.sort_by_expert(top_i, num_experts=8)
    got = torch.full_like(ref, float("nan"))
    MK.experts_grouped(got, h, order, offs, k, *w, torch.empty(n * k, 32), _silu_mul, tile=5)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
