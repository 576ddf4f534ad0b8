"""A stacked round never makes the host wait for the device (engine/batching.py, engine/steps.py):
the stacked step reads nothing back (its NaN test is split per request on the device,
published.segment_nan, and each run holds its own flag), and a dual-cache threshold round reads
nothing but the runs' own readbacks (runtime/readback.py). On a GPU every such read waited for
the whole stacked step while the device then idled through every request's sampler. A NaN in one
request's rows fails that request only; its batch-mates keep their tokens alone."""

from contextlib import contextmanager

import pytest
import torch
from conftest import random_model

import mosaic.runtime.samplers.fast_llada as F
from mosaic import MosaicEngine
from mosaic.engine import batching
from mosaic.engine.scheduler import Scheduler
from mosaic.errors import NumericsError
from mosaic.runtime import readback

READS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy")
CASES = {      # several requests whose calls stack: (family, [(prompt, options)])
    "dual-threshold": ("llada", [([3, 4, 5, 6], dict(max_new_tokens=8, steps=8, block_length=4, cache="dual",
                                                     threshold=0.9)),
                                 ([7, 8, 9], dict(max_new_tokens=8, steps=8, block_length=4, cache="dual",
                                                  threshold=0.5)),
                                 ([5, 6, 1, 2], dict(max_new_tokens=8, steps=8, block_length=4, cache="dual",
                                                     threshold=0.9))]),
    "plain": ("llada", [([3, 4, 5, 6], dict(max_new_tokens=8, steps=8, block_length=4)),
                        ([7, 8, 9, 10, 11, 12, 13], dict(max_new_tokens=8, steps=8, block_length=4)),
                        ([5, 6], dict(max_new_tokens=4, steps=4))]),
    # every layer dense: on the CPU the MoE loop reads its group offsets by design (kernels/moe.py;
    # a GPU step groups them on the device)
    "diffusion": ("llada2", [([3, 4, 5, 6], dict(max_new_tokens=8)), ([7, 8, 9], dict(max_new_tokens=8)),
                             ([5, 6, 1, 2, 9], dict(max_new_tokens=8))]),
}


class Reads:
    """Counts host reads of tensors (READS) while `on`, by where they come from."""

    def __init__(self, monkeypatch):
        self.on, self.seen = False, []
        for name in READS:
            real = getattr(torch.Tensor, name)

            def read(t, *a, _real=real, _name=name, **k):
                if self.on:
                    self.seen.append(_name)
                return _real(t, *a, **k)
            monkeypatch.setattr(torch.Tensor, name, read)

    @contextmanager
    def counting(self, on=True):
        was, self.on = self.on, on
        try:
            yield
        finally:
            self.on = was


def _model(case):
    family = CASES[case][0]
    return random_model(family, **({"first_dense": 3} if family == "llada2" else {}))


def _runs(eng, case):
    return [eng.start(eng.request(p, **o)) for p, o in CASES[case][1]]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_stacked_step_reads_nothing_from_the_device(case, monkeypatch):
    eng = MosaicEngine(_model(case), {"progress": False})
    reads = Reads(monkeypatch)
    real = batching.RoundExecutor._stacked

    def stacked(self, runs):
        with reads.counting():
            return real(self, runs)
    monkeypatch.setattr(batching.RoundExecutor, "_stacked", stacked)
    sched = Scheduler(eng)
    for run in _runs(eng, case):
        sched.add(run)
    ended = sched.run_all()
    assert all(f.error is None for f in ended) and not sched.stats.fallbacks, sched.stats.fallbacks
    assert sched.stats.stacked_steps > 0
    assert reads.seen == []


def test_a_dual_cache_threshold_round_reads_only_the_runs_readbacks(monkeypatch):
    """From the stacked step's launch to the runs' next calls (their samplers' commits, the next
    step launched ahead, a block's next fill: fast_llada._block_ahead), only Readback.read reads."""
    monkeypatch.setattr(F, "RUN_AHEAD", True)
    eng = MosaicEngine(random_model("llada"), {"progress": False})
    reads = Reads(monkeypatch)
    real_round, real_read = batching.RoundExecutor.run_round, readback.Readback.read
    real_update, real_end = Scheduler._update, Scheduler._end

    def run_round(self, work):
        with reads.counting():
            return real_round(self, work)

    def update(self, work, outcomes):
        with reads.counting():
            return real_update(self, work, outcomes)

    def end(self, run, error=None):          # a run that ended: its result is read (not a round's)
        with reads.counting(False):
            return real_end(self, run, error)

    def read(self):
        with reads.counting(False):
            return real_read(self)
    monkeypatch.setattr(batching.RoundExecutor, "run_round", run_round)
    monkeypatch.setattr(Scheduler, "_update", update)
    monkeypatch.setattr(Scheduler, "_end", end)
    monkeypatch.setattr(readback.Readback, "read", read)
    alone = [eng.generate(p, **o).tokens for p, o in CASES["dual-threshold"][1]]
    sched = Scheduler(eng)
    runs = _runs(eng, "dual-threshold")
    for run in runs:
        sched.add(run)
    ended = {id(f.run): f for f in sched.run_all()}
    assert all(f.error is None for f in ended.values())
    for run, want in zip(runs, alone):
        assert torch.equal(ended[id(run)].generation.tokens, want)
    assert sched.stats.stacked_steps > 0 and reads.seen == []


@pytest.mark.parametrize("case", ["dual-threshold", "plain"])
def test_a_nan_in_one_requests_rows_of_a_stacked_step_fails_that_request_only(case, monkeypatch):
    """Request 1's rows of every stacked step are NaN: it fails with NumericsError at its own
    readback; the stacked steps do not fall back to running alone, and the other requests get
    their tokens alone."""
    eng = MosaicEngine(_model(case), {"progress": False})
    alone = [eng.generate(p, **o).tokens for p, o in CASES[case][1]]
    runs = _runs(eng, case)
    real = eng.executor.runner.execute
    poisoned = []

    def execute(step, prepared, probe=None, interrupt=None):
        outs = real(step, prepared, probe, interrupt)
        red = step.reducer
        if isinstance(red, batching.StackedReducer) and runs[1].pending is not None:
            for part, o, c in zip(red.parts, red.offsets, red.counts):
                if part is runs[1].pending.reducer:
                    outs["conf"][o:o + c] = float("nan")
                    poisoned.append(c)
        return outs
    monkeypatch.setattr(eng.executor.runner, "execute", execute)
    sched = Scheduler(eng)
    for run in runs:
        sched.add(run)
    ended = {id(f.run): f for f in sched.run_all()}
    assert poisoned and not sched.stats.fallbacks, sched.stats.fallbacks
    assert isinstance(ended[id(runs[1])].error, NumericsError)
    for i in (0, 2):
        assert ended[id(runs[i])].error is None and torch.equal(ended[id(runs[i])].generation.tokens, alone[i])
