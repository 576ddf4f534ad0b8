"""Admission of a request with an output constraint charges the constrained steps as they run
(runtime/samplers/constrained_reducer.py: the window's rows on the buffer path, the saved logits,
the copy of the outputs and the walk's masked row), not the unconstrained first step: at the
tightest budget it admits, the request runs to completion; a byte below, it is refused before
any step is prepared. On a random byte-level LLaDA checkpoint (V = 260 over a 32-wide hidden
state: the logits phase holds the peak), Fast-dLLM's threshold loop (float64 confidences)."""

from __future__ import annotations

import pytest
import torch

from bench.lib.byte_models import byte_checkpoint
from mosaic import MosaicEngine
from mosaic.errors import MemoryBudgetError
from mosaic.loader import load

pytest.importorskip("outlines_core")

KW = dict(max_new_tokens=32, block_length=16, threshold=0.9, regex="[a-f]{3,20}")
PROMPTS = ["hello", "world"]
ONE = ["hello"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load(str(byte_checkpoint("llada", tmp_path_factory.mktemp("adm") / "llada", 0)), device="cpu",
                dtype="float32")


def engine(model, budget=None):
    return MosaicEngine(model, {"progress": False} | ({"memory_budget": budget} if budget else {}))


def admits(model, request, budget) -> bool:
    try:
        engine(model, budget).admit(request.batch, request.length, request.gen, constrained=True)
        return True
    except MemoryBudgetError:
        return False


def test_admission_charges_the_constrained_step_exactly(model):
    e = engine(model)
    req = e.request(PROMPTS, **KW)
    adm = e.admit(req.batch, req.length, req.gen, constrained=True)
    free = e.admit(req.batch, req.length, req.gen)
    # the unconstrained first step (what admission charged before) is smaller than what runs
    assert adm.prepared.need_bytes > free.prepared.need_bytes
    seen = len(e.preparer.history)
    out = e.generate(PROMPTS, **KW)
    run = [h.plan_bytes + h.external_bytes for h in e.preparer.history[seen:]]
    assert max(run) == adm.prepared.need_bytes and out.stats["structured"]["rows_masked"] > 0


def test_tightest_budget_runs_and_a_byte_below_is_refused_before_any_work(model):
    # one prompt: generate() admits each prompt of a list alone and runs what does not fit
    # together in waves, so only a single request is refused outright a byte below
    e = engine(model)
    req = e.request(ONE, **KW)
    adm = e.admit(req.batch, req.length, req.gen, constrained=True)
    lo, hi = adm.predicted_bytes - adm.prepared.need_bytes, adm.predicted_bytes   # nothing for activations .. all
    assert not admits(model, req, lo) and admits(model, req, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if admits(model, req, mid) else (mid, hi)
    tight = engine(model, hi)
    out = tight.generate(ONE, **KW)                   # runs to completion under the budget it was admitted at
    assert out.texts == e.generate(ONE, **KW).texts and out.predicted_bytes <= hi
    admitted = tight.admit(req.batch, req.length, req.gen, constrained=True).prepared.need_bytes
    assert max(h.plan_bytes + h.external_bytes for h in tight.preparer.history) <= admitted
    below = engine(model, hi - 1)
    with pytest.raises(MemoryBudgetError, match="longest that fits"):
        below.generate(ONE, **KW)
    assert below.preparer.history == []                   # refused before any step was prepared
    assert torch.equal(out.tokens, tight.generate(ONE, **KW).tokens)
