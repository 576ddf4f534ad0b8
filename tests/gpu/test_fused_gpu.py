"""Fused gate|up projections and the block-step kernels on the GPU: the same bits as the separate
GEMMs, and every step's outputs (plain steps of 32-2048 masked rows, dual and prefix block
steps) bit-identical to the unfused engine's, with the planned step's tokens equal to native.
Skipped without CUDA. (The fused elementwise kernels' bits: tests/kernels/test_elementwise.py,
which runs on the GPU when one is present.)"""

import pytest
import torch
from conftest import needs_cuda

from mosaic import MosaicEngine, load

pytestmark = [pytest.mark.gpu, needs_cuda]

PRESETS = ["llada-8b", "dream-7b", "illada-8b"]


@pytest.mark.parametrize("rows", [32, 64, 512, 2048])
@pytest.mark.parametrize("name", PRESETS)
def test_fused_gate_up_gemm_bits_equal_separate(name, rows):
    model = load(name, device="cuda", num_layers=1)
    lw = {k: t.clone() for k, t in model.layers[0].items()}
    model.fuse_projections(("gate_up",))
    fw = model.fused[0]["gate_up"]
    F = fw.shape[0] // 2
    h = torch.randn(rows, model.cfg.hidden, device="cuda", dtype=model.dtype)
    gu = torch.mm(h, fw.t())
    assert torch.equal(gu[:, :F], torch.mm(h, lw["gate"].t()))
    assert torch.equal(gu[:, F:], torch.mm(h, lw["up"].t()))
    g = gu[:, :F]                                      # the down projection reads the strided half
    assert torch.equal(torch.mm(g, lw["down"].t()), torch.mm(g.contiguous(), lw["down"].t()))


def _canvas(model, n, m, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 1000, (1, n), generator=g)
    x[:, n - m:] = model.cfg.mask_id
    return x.cuda()


@pytest.mark.parametrize("name", PRESETS)
def test_plain_steps_equal_unfused_and_native(name):
    """Plain steps (never fused: models/fusion.fused_of) with the fused norm kernels (rsqrt inside
    the scale kernel) give the native forward's tokens at 32-2048 masked rows."""
    fused_model, plain_model = (load(name, device="cuda", num_layers=2) for _ in range(2))
    fused = MosaicEngine(fused_model, {"progress": False})
    plain = MosaicEngine(plain_model, {"progress": False, "fused_projections": "off"})
    for n, m in ((512, 32), (1024, 64), (1024, 512), (2048, 2048)):
        x = _canvas(fused_model, n, m)
        a, b = fused.step(x), plain.step(x)
        assert all(torch.equal(p, q) for p, q in zip(a, b)), (n, m)
        assert torch.equal(a[0], fused.step(x, native=True)[0]), (n, m)   # tokens equal native


@pytest.mark.parametrize("cache", ["dual", "prefix"])
@pytest.mark.parametrize("name", PRESETS)
def test_block_path_gives_the_per_chunk_path_tokens(name, cache, monkeypatch):
    """A block-cache request on the block-step path (one norm for q, k, v, per-step RoPE tables,
    q and k rotated in one launch, the residual added in the FFN's norm, gate|up fused; eager and
    captured) against the per-chunk path of the same shapes, unfused, eager."""
    from mosaic.models import kv_cache
    fused_model, plain_model = (load(name, device="cuda", num_layers=2) for _ in range(2))
    ids = _canvas(fused_model, 600, 0)[0].tolist()
    kw = dict(max_new_tokens=64, steps=64, block_length=32, cache=cache, threshold=0.9)
    if name == "dream-7b":
        kw["alg"] = "maskgit_plus"
    monkeypatch.setattr(kv_cache, "BLOCK_PATH", False)
    plain = MosaicEngine(plain_model, {"progress": False, "fused_projections": "off", "cuda_graphs": "off"})
    want = plain.generate(ids, **kw).tokens
    monkeypatch.setattr(kv_cache, "BLOCK_PATH", True)
    fused = MosaicEngine(fused_model, {"progress": False})
    for _ in range(3):    # eager, captured, replayed
        assert torch.equal(fused.generate(ids, **kw).tokens, want)
    assert fused.graphs.stats.replays > 0
