"""The samplers' device-side commits (runtime/commit.py) against the published host calls
(runtime/commit_host.py: torch.topk per row, or over the batch for Dream) at every step of real
runs on the bundled models and a tiny LLaDA2 checkpoint: each step's device mask equals the host
call's on every row no tie decides, and the run's tokens are the ones the tests of each sampler
compare with the published loops (test_fast_decoding, test_block_diffusion, test_ties). bfloat16
makes ties frequent (probabilities round to 1.0); left-padded batches give rows with other counts
and rows that finish (no candidates) before the others."""

import pytest
import torch
from conftest import bundled, left_padded, random_model

from mosaic import MosaicEngine
from mosaic.runtime import commit
from mosaic.runtime.samplers import block_diffusion, dream, fast_dream, fast_llada, llada

PROMPTS = ["123+456=", "8+8=", "sort 907=", "57+384="]


def padded(e, prompts) -> dict:
    """generate()'s arguments for ONE left-padded request of these prompts' rows (a list of
    prompts would be a batch of one-row requests)."""
    ids = [p if isinstance(p, list) else e.encode(p)[0] for p in prompts]
    inputs, mask = left_padded(e.model.cfg, ids)
    return {"inputs": inputs, "attention_mask": mask}


@pytest.fixture
def spy(monkeypatch):
    """Every commit the samplers apply: checks its device mask against the published call on all
    rows, counts rows (compared, tied)."""
    seen = {"rows": 0, "tied": 0, "steps": 0}

    def check(c):
        B = c.mask.shape[0]
        host = c.exact(list(range(B)))
        untied = ~c.tied
        assert torch.equal(c.mask[untied], host[untied])
        seen["rows"] += B
        seen["tied"] += int(c.tied.sum())
        seen["steps"] += 1

    def checked(x, x0, c, after=None):
        check(c)
        return commit.apply(x, x0, c, after)

    def checked_async(x, x0, c, after):     # LLaDA's cached blocks run ahead (fast_llada._block_ahead)
        check(c)
        return commit.apply_async(x, x0, c, after)
    for mod in (fast_llada, llada, dream, fast_dream, block_diffusion):
        monkeypatch.setattr(mod, "apply", checked)
    monkeypatch.setattr(fast_llada, "apply_async", checked_async)
    return seen


LLADA_OPTIONS = [dict(), dict(threshold=0.9), dict(factor=1.0), dict(cache="prefix"), dict(cache="dual", threshold=0.9),
                 dict(cache="dual", factor=1.0), dict(cache="prefix", threshold=0.7)]


@pytest.mark.parametrize("options", LLADA_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "exact")
def test_llada_device_commits_equal_host(spy, options):
    e = MosaicEngine(bundled("tiny-llada"), {"progress": False, "dtype": "bfloat16"})
    kw = dict(max_new_tokens=8, steps=8, block_length=4, **options)
    together = e.generate(**padded(e, PROMPTS), **kw).tokens
    alone = e.generate(PROMPTS[1], **kw).tokens[0]
    assert torch.equal(alone, together[1])     # ties ranked from the row's first token (ties.py)
    assert spy["steps"] > 0 and spy["rows"] >= 4 * spy["steps"] // 2


DREAM_OPTIONS = [dict(), dict(alg="entropy"), dict(threshold=0.9, alg="maskgit_plus"),
                 dict(cache="dual", threshold=0.9, alg="maskgit_plus", block_length=4),
                 dict(cache="prefix", alg="entropy", block_length=4),
                 dict(cache="dual", factor=1.0, alg="maskgit_plus", block_length=4)]


@pytest.mark.parametrize("options", DREAM_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "exact")
def test_dream_device_commits_equal_host(spy, options):
    e = MosaicEngine(bundled("tiny-dream"), {"progress": False, "dtype": "bfloat16"})
    e.generate(**padded(e, PROMPTS), max_new_tokens=8, steps=8, **options)
    assert spy["steps"] > 0


def test_ties_are_met_and_resolved(spy):
    """bfloat16 exact LLaDA: the runs above do meet tied rows, which the published call settles."""
    e = MosaicEngine(bundled("tiny-llada"), {"progress": False, "dtype": "bfloat16"})
    e.generate(**padded(e, PROMPTS), max_new_tokens=8, steps=4)
    assert spy["tied"] > 0


@pytest.mark.parametrize("threshold", [0.3, 0.95])
def test_llada2_device_commits_equal_host(spy, threshold):
    model = random_model("llada2", dtype=torch.bfloat16)
    e = MosaicEngine(model, {"progress": False})
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, model.cfg.mask_id - 4, (n,), generator=g).tolist() for n in (3, 9, 5)]
    e.generate(**padded(e, batch), max_new_tokens=12, block_length=4, steps=4, threshold=threshold)
    assert spy["steps"] > 0
