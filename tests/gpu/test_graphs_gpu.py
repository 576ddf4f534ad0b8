"""Captured steps on the GPU: replay gives the eager path's outputs bit for bit and its tokens,
and captures really happen. Skipped without CUDA."""

import pytest
import torch
from conftest import bundled, needs_cuda

from mosaic import MosaicEngine, load

pytestmark = [pytest.mark.gpu, needs_cuda]


def _pair(model):
    return (MosaicEngine(model, {"progress": False}),
            MosaicEngine(model, {"progress": False, "cuda_graphs": "off"}))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_replayed_step_outputs_are_bit_identical_to_eager(family, dtype):
    model = load("llada-8b" if family == "llada" else "dream-7b", device="cuda", dtype=dtype, num_layers=2)
    graphs, eager = _pair(model)
    x = torch.randint(0, 1000, (1, 96), device="cuda")
    x[:, 64:] = model.cfg.mask_id
    ref = eager.step(x)
    for _ in range(3):                       # eager, capture + replay, replay
        got = graphs.step(x)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert graphs.graphs.stats.captures == 1 and graphs.graphs.stats.replays == 2


@pytest.mark.parametrize("opts", [dict(block_length=8), dict(block_length=8, cache="dual", threshold=0.9),
                                  dict(block_length=8, cache="prefix", threshold=0.9)])
def test_replayed_generation_gives_the_eager_tokens(opts):
    graphs, eager = _pair(str(bundled("tiny-llada")))
    batch = ["sort 31415926=", "sort 90817=", "sort 5555=", "sort 123456="]
    for _ in range(2):
        assert torch.equal(graphs.generate(batch, max_new_tokens=16, steps=16, **opts).tokens,
                           eager.generate(batch, max_new_tokens=16, steps=16, **opts).tokens)
    st = graphs.graphs.stats
    assert st.captures >= 1 and st.replays > st.captures and not st.failures, st
