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


class Asked:
    """A run's cancelled(): counts its questions; true from question `limit` + 1 on."""

    def __init__(self):
        self.n, self.limit = 0, float("inf")

    def __call__(self):
        self.n += 1
        return self.n > self.limit


def _stacked_round(eng, asks, opts):
    """A Scheduler with one run per `asks`, stepped until their block steps stack; returns it."""
    from mosaic.engine.scheduler import Scheduler
    sched = Scheduler(eng)
    for a in asks:
        sched.add(eng.start(eng.request(PROMPT, **opts), cancelled=a))
    sched.step()                             # the fills (stacked: one length)
    return sched


@pytest.mark.parametrize("all_cancelled", [True, False])
def test_a_stacked_step_stops_inside_only_when_every_request_in_it_is_cancelled(all_cancelled):
    eng = MosaicEngine(random_model("llada"), {"progress": False})
    opts = OPTS | dict(cache="dual", block_length=4)
    asks = [Asked(), Asked()]
    sched = _stacked_round(eng, asks, opts)
    steps0 = sched.stats.stacked_steps
    for a in asks if all_cancelled else asks[:1]:
        a.limit = a.n + (3 if all_cancelled else 2)   # false when the round starts, true inside its step
    done = sched.step()
    if all_cancelled:                        # interrupted: both end in the step, nobody ran it whole
        assert len(done) == 2 and all("during step" in str(f.error) for f in done)
        assert isinstance(done[0].error, RequestCancelled) and sched.stats.fallbacks == []
        assert not sched.running
    else:                                    # the step ran for both; the cancelled one leaves next round
        assert done == [] and sched.stats.stacked_steps == steps0 + 1
        asks[0].limit = 0                    # (cancelled for good, however often it was asked)
        done = sched.step()
        assert [isinstance(f.error, RequestCancelled) for f in done] == [True]
        rest = sched.run_all()
        assert len(rest) == 1 and rest[0].error is None
