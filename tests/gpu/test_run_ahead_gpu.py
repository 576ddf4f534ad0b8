"""Block steps launched one ahead of the host's readback (runtime/samplers/fast_llada.RUN_AHEAD)
on the GPU, captured: the same tokens, NFE and per-row NFE as the loop that waits for every
readback, alone and in a batch of two, dual and prefix. Skipped without CUDA. (Its speed:
`python -m bench everyday --only profile`, key run_ahead.)"""

import pytest
import torch
from conftest import needs_cuda

import mosaic.runtime.samplers.fast_llada as F
from mosaic import MosaicEngine, load

pytestmark = [pytest.mark.gpu, needs_cuda]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("rule", [dict(threshold=0.9), dict(factor=1.0)], ids=["threshold", "factor"])
@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_run_ahead_equals_the_plain_loop_captured(cache, rule, batch, monkeypatch):
    model = load("llada-8b", device="cuda", num_layers=2)
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, model.cfg.mask_id - 4, (batch, 200), generator=g)
    kw = dict(max_new_tokens=64, steps=64, block_length=32, cache=cache, **rule)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(F, "RUN_AHEAD", on)
        e = MosaicEngine(model, {"progress": False})
        e.generate(ids, **kw)                                   # the shapes' eager run and capture
        outs.append(e.generate(ids, **kw))
        assert e.graphs.stats.replays > 0
    plain, ahead = outs
    assert torch.equal(plain.tokens, ahead.tokens)
    assert plain.stats["nfe"] == ahead.stats["nfe"] and plain.stats["nfe_per_row"] == ahead.stats["nfe_per_row"]
