"""Cancellation inside a step (engine/run.py, graph/ctx.py Ctx.interrupt): a request whose
cancelled() turns true while a planned step runs stops after the op that is running, not at the
end of the step, and the engine's next request gets exactly its tokens (CPU, float32)."""

import pytest
import torch
from conftest import random_model

from mosaic import MosaicEngine
from mosaic.engine import RequestCancelled

PROMPT, OPTS = [3, 4, 5, 6, 7], dict(max_new_tokens=8, steps=4)


def ops_per_step(eng) -> int:
    seen = []
    eng.generate(PROMPT, **(OPTS | dict(steps=1, max_new_tokens=8)), probe=lambda ctx, name: seen.append(name))
    return len(seen)


@pytest.mark.parametrize("fam", ["llada", "dream"])
@pytest.mark.parametrize("block", [False, True])
def test_a_request_cancelled_inside_a_step_stops_after_the_running_op(fam, block):
    eng = MosaicEngine(random_model(fam), {"progress": False})
    opts = OPTS | (dict(cache="dual", block_length=4) if block else {})
    want = eng.generate(PROMPT, **opts).tokens
    per_step = ops_per_step(eng)
    asked = [0]

    def cancelled():            # true from its 6th question on: inside the first step
        asked[0] += 1
        return asked[0] > 5

    with pytest.raises(RequestCancelled, match="during step 1"):
        eng.generate(PROMPT, cancelled=cancelled, **opts)
    assert asked[0] == 6 < per_step           # one question before the step, then one per op
    assert torch.equal(eng.generate(PROMPT, **opts).tokens, want)


def test_a_request_never_cancelled_asks_after_every_op_and_keeps_its_tokens():
    eng = MosaicEngine(random_model("llada"), {"progress": False})
    want = eng.generate(PROMPT, **OPTS).tokens
    asked = [0]

    def cancelled():
        asked[0] += 1
        return False

    assert torch.equal(eng.generate(PROMPT, cancelled=cancelled, **OPTS).tokens, want)
    assert asked[0] > OPTS["steps"] * 10


def test_a_block_diffusion_request_cancelled_inside_a_block_step_stops_there():
    eng = MosaicEngine(random_model("llada2"), {"progress": False})
    opts = dict(max_new_tokens=8, block_length=4, steps=4)
    want = eng.generate(PROMPT, **opts).tokens
    asked = [0]

    def cancelled():
        asked[0] += 1
        return asked[0] > 5

    with pytest.raises(RequestCancelled, match="during step"):
        eng.generate(PROMPT, cancelled=cancelled, **opts)
    assert asked[0] == 6
    assert torch.equal(eng.generate(PROMPT, **opts).tokens, want)


def test_on_a_cpu_a_cancelled_long_request_stops_within_seconds():
    """On a CPU each op's work is bounded (policy/op_work.py), so cancellation, which waits for
    the op in flight, comes within about a second: a 50,000-token request of tiny-llada (no
    budget) used to run one attention op of 16,384 query rows for a minute or more here."""
    import time
    import warnings

    eng = MosaicEngine("tiny-llada", {"device": "cpu", "progress": False})
    t_cancel = [None]

    def cancelled():
        now = time.perf_counter()
        if t_cancel[0] is None:
            t_cancel[0] = now + 2.0                 # two seconds into the request
        return now > t_cancel[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")             # beyond the trained 64 tokens
        with pytest.raises(RequestCancelled):
            eng.generate([5] * 50_000, max_new_tokens=8, steps=1, cancelled=cancelled)
    late = time.perf_counter() - t_cancel[0]
    assert late < 5.0, f"stopped {late:.1f} s after the cancel"
