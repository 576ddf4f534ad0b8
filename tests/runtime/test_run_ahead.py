"""A cached block's next step launched before the host reads the last one (runtime/samplers/
fast_llada._block_ahead, runtime/readback.py): the same tokens, NFE and per-row NFE as the loop
that waits for every readback (RUN_AHEAD off, the oracle), for every rule and both caches, a
padded batch, ties, NaN probabilities and a stop from on_step."""

import pytest
import torch
from conftest import left_padded, random_model

import mosaic.runtime.samplers.fast_llada as F
from mosaic import MosaicEngine
from mosaic.errors import NumericsError
from mosaic.runtime import published as P
from mosaic.runtime.commit import Commit
from mosaic.runtime.readback import Readback

RULES = [dict(threshold=0.2), dict(factor=1.0), dict()]


def both(model, prompt, monkeypatch, **kw):
    """(the plain loop's Generation, the run-ahead loop's) for one request."""
    outs = []
    for on in (False, True):
        monkeypatch.setattr(F, "RUN_AHEAD", on)
        outs.append(MosaicEngine(model, {"progress": False}).generate(prompt, **kw))
    return outs


@pytest.mark.parametrize("rule", RULES, ids=["threshold", "factor", "counts"])
@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_run_ahead_equals_the_plain_loop(cache, rule, monkeypatch):
    model = random_model("llada")
    plain, ahead = both(model, [5, 9, 2, 7, 1, 3], monkeypatch, max_new_tokens=16, steps=16, block_length=4,
                        cache=cache, **rule)
    assert torch.equal(plain.tokens, ahead.tokens)
    assert plain.stats["nfe"] == ahead.stats["nfe"] == ahead.steps
    assert plain.stats["nfe_per_row"] == ahead.stats["nfe_per_row"]
    assert "forwards_discarded" not in plain.stats
    # a block done before its last allowed step leaves one step launched ahead unused; the
    # schedule (counts) always runs its steps
    if not rule:
        assert ahead.stats["forwards_discarded"] == 0
    if rule.get("threshold"):
        assert ahead.stats["forwards_discarded"] > 0


def test_run_ahead_padded_batch(monkeypatch):
    model = random_model("llada")
    cfg = model.cfg
    ids, mask = left_padded(cfg, [[4, 8, 1, 6], [3, 9, 2, 7, 5, 1]])
    outs = []
    for on in (False, True):
        monkeypatch.setattr(F, "RUN_AHEAD", on)
        e = MosaicEngine(model, {"progress": False})
        outs.append(e.generate(inputs=ids, attention_mask=mask, max_new_tokens=8, steps=8, block_length=4,
                               cache="dual", threshold=0.3))
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert outs[0].stats["nfe_per_row"] == outs[1].stats["nfe_per_row"]


def test_a_tie_reruns_the_step_launched_ahead(monkeypatch):
    """Every step reports a tie (its mask is the published call's anyway): the readback shows it,
    the published call commits, and the step launched on the unsettled canvas is run again."""
    real = F.commit_threshold

    def tied(conf, threshold, starts=None, allowed=None):
        c = real(conf, threshold, starts, allowed)
        return Commit(c.mask, torch.isfinite(conf).any(1), c.exact)
    model = random_model("llada")
    kw = dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.2)
    monkeypatch.setattr(F, "RUN_AHEAD", True)
    ref = MosaicEngine(model, {"progress": False}).generate([5, 9, 2, 7], **kw)
    monkeypatch.setattr(F, "commit_threshold", tied)
    plain, ahead = both(model, [5, 9, 2, 7], monkeypatch, **kw)
    assert torch.equal(ref.tokens, plain.tokens) and torch.equal(plain.tokens, ahead.tokens)
    assert plain.stats["nfe"] == ahead.stats["nfe"] == ref.stats["nfe"]
    # every accepted block step after the first was launched twice
    assert ahead.stats["forwards_discarded"] > ref.stats["forwards_discarded"]


def test_nan_fails_before_any_step_and_a_stop_from_on_step(monkeypatch):
    monkeypatch.setattr(F, "RUN_AHEAD", True)
    model = random_model("llada", dtype=torch.float16)
    model.lm_head.mul_(6e4)                                                # logits overflow float16
    e = MosaicEngine(model, {"progress": False})
    kw = dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.9)
    seen = []
    with pytest.raises(NumericsError, match="NaN in float16"):
        e.generate([1, 2, 3], on_step=lambda *a: seen.append(a), **kw)
    assert seen == [] and P.take_checks() == []
    model.lm_head.div_(6e4)
    out = e.generate([1, 2, 3], on_step=lambda i, x: i >= 2, **kw)       # stopped after two steps
    assert out.steps == 2 and P.take_checks() == []


def test_readback_carries_its_own_tests_only():
    P.clear_checks()
    P.defer_check(torch.tensor([float("nan")]), torch.bfloat16)
    r = Readback(torch.tensor([[1, 2], [3, 4]]))
    P.defer_check(torch.tensor([0.5]), torch.float32)                      # a later step's: not r's
    with pytest.raises(NumericsError, match="bfloat16"):
        r.read()
    assert len(P.take_checks()) == 1
    assert Readback(torch.tensor([[7], [8]], dtype=torch.int32)).read() == [[7], [8]]


def test_fills_read_their_candidates_only_after_a_block_left_masks(monkeypatch):
    """A fill predicts its block's rows without reading the candidates (no nonzero, which waits
    for the device) while every candidate lies in the block; once a block ends with mask ids
    committed in it (here the mask token's LM-head row is token 20's, so the model predicts it),
    the next fill's candidates include them and it reads them: tokens and NFE stay the plain
    loop's either way."""
    model = random_model("llada", seed=0)
    model.lm_head[model.cfg.mask_id] = model.lm_head[20] * 1.01
    kw = dict(max_new_tokens=16, steps=16, block_length=4, cache="dual", threshold=0.2)
    calls = []
    real = torch.Tensor.nonzero

    def nonzero(t, *a, **k):
        calls.append(t.shape)
        return real(t, *a, **k)
    monkeypatch.setattr(torch.Tensor, "nonzero", nonzero)
    plain, ahead = both(model, [5, 9, 2, 7, 1, 3], monkeypatch, **kw)
    assert torch.equal(plain.tokens, ahead.tokens) and plain.stats["nfe_per_row"] == ahead.stats["nfe_per_row"]
    blocks = plain.tokens[0].view(4, 4) == model.cfg.mask_id
    assert blocks[2].any() and not blocks[:2].any()        # block 2 ended with masks: block 3's fill reads
    assert len(calls) == plain.stats["nfe"] + 1            # the plain loop: every step; ahead: one fill
