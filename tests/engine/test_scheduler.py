"""The Scheduler's policy with fake runs and a fake round executor (engine/scheduler.py): first
come first served, budget-limited joins that never overtake, no eviction, one cancellation path
(waiting and running), errors that end only their own run."""

import threading
from types import SimpleNamespace

import pytest

from mosaic.engine.batching import Work
from mosaic.engine.run import RequestCancelled
from mosaic.engine.scheduler import Scheduler


class FakeRun:
    """What the Scheduler reads of a RequestRun: `steps` calls, each a plain step of rows x length."""

    def __init__(self, name, steps=3, rows=1, length=16, log=None, fail_at=None):
        self.name, self.steps, self.log, self.fail_at = name, steps, log if log is not None else [], fail_at
        self.request = SimpleNamespace(batch=rows, length=length, native=False, grammar=None,
                                       gen=SimpleNamespace(max_new_tokens=8))
        self.total_steps, self.steps_done = steps, 0
        self.pending, self.started, self.closed = None, False, False
        self.cancel_event = threading.Event()

    @property
    def done(self):
        return self.started and self.steps_done == self.steps

    def start(self):
        self.started = True
        self.log.append(("start", self.name))
        self.pending = ("step", self.name, 0)

    def advance(self, outs):
        assert outs == ("out", self.name, self.steps_done)
        self.steps_done += 1
        self.pending = None if self.done else ("step", self.name, self.steps_done)

    def cancel(self):
        self.cancel_event.set()

    def is_cancelled(self):
        return self.cancel_event.is_set()

    def check_cancelled(self):
        if self.is_cancelled():
            raise RequestCancelled(f"{self.name} cancelled after {self.steps_done} of {self.total_steps} steps")

    def close(self):
        self.closed = True

    def result(self):
        return SimpleNamespace(name=self.name, steps=self.steps_done)


class FakeExecutor:
    """Runs each item's pending call: its outputs, or an error for a run that fails there."""

    def __init__(self):
        self.rounds, self.dropped = [], []
        self.stats = SimpleNamespace(steps=0)

    def run_round(self, work):
        self.rounds.append([w.run.name for w in work])
        out = []
        for w in work:
            r = w.run
            if r.fail_at == r.steps_done:
                out.append(RuntimeError(f"{r.name} failed"))
            else:
                out.append(("out", r.name, r.steps_done))
        return out

    def drop(self, run):
        self.dropped.append(run.name)


def scheduler(max_rows=None, max_seqs=64):
    """A Scheduler over fakes; under a budget that admits at most `max_rows` rows at once."""
    fits = (lambda rows, length, gen, constrained=False: rows <= max_rows) if max_rows is not None \
        else (lambda *a, **k: True)
    engine = SimpleNamespace(memory=SimpleNamespace(has_budget=max_rows is not None),
                             admitter=SimpleNamespace(fits=fits),
                             model=SimpleNamespace(cfg=SimpleNamespace(num_layers=4)))
    return Scheduler(engine, max_seqs=max_seqs, executor=FakeExecutor())


def test_runs_join_first_come_first_served_and_run_together():
    s, log = scheduler(), []
    runs = [FakeRun(n, steps=2, log=log) for n in "abc"]
    for r in runs:
        s.add(r)
    ended = s.run_all()
    assert log == [("start", "a"), ("start", "b"), ("start", "c")]
    assert s.executor.rounds == [["a", "b", "c"], ["a", "b", "c"]]
    assert [f.run.name for f in ended] == ["a", "b", "c"] and all(f.error is None for f in ended)
    assert [f.generation.steps for f in ended] == [2, 2, 2] and all(r.closed for r in runs)


def test_a_newcomer_that_does_not_fit_waits_and_nobody_overtakes_it():
    s = scheduler(max_rows=3)
    a, b, c = FakeRun("a", steps=4, rows=2), FakeRun("b", steps=1, rows=2), FakeRun("c", steps=1, rows=1)
    for r in (a, b, c):
        s.add(r)
    s.step()
    # b does not fit next to a (4 rows > 3); c would (3 rows), but it came later: it waits too
    assert [r.name for r in s.running] == ["a"] and [r.name for r in s.waiting] == ["b", "c"]
    while a.steps_done < a.steps:
        assert s.running[0] is a              # running work is never evicted for the waiting
        s.step()
    s.run_all()
    assert s.executor.rounds[:4] == [["a"]] * 4
    assert s.executor.rounds[4] == ["b", "c"]     # together once a left


def test_max_seqs_caps_the_running_sequences():
    s = scheduler(max_seqs=2)
    for n in "abcd":
        s.add(FakeRun(n, steps=2))
    s.step()
    assert [r.name for r in s.running] == ["a", "b"] and len(s.waiting) == 2
    s.run_all()
    assert s.executor.rounds == [["a", "b"], ["a", "b"], ["c", "d"], ["c", "d"]]


def test_an_empty_batch_takes_what_admission_admitted():
    s = scheduler(max_rows=1)
    big = FakeRun("big", rows=4)            # admitted alone before it was queued
    s.add(big)
    s.step()
    assert s.running == [big]


def test_cancelling_a_waiting_run_ends_it_before_it_starts():
    s = scheduler(max_rows=1)
    a, b, c = FakeRun("a", steps=3), FakeRun("b"), FakeRun("c")
    for r in (a, b, c):
        s.add(r)
    s.step()
    s.cancel(b)                             # from any thread: a flag, acted on at the next step
    ended = s.step()
    assert [(f.run.name, type(f.error).__name__) for f in ended] == [("b", "RequestCancelled")]
    assert not b.started and b.closed and "before it started" in str(ended[0].error)
    rest = s.run_all()
    assert [f.run.name for f in rest] == ["a", "c"] and all(f.error is None for f in rest)


def test_cancelling_a_running_run_ends_it_at_the_next_step_and_the_others_go_on():
    s = scheduler()
    a, b = FakeRun("a", steps=4), FakeRun("b", steps=4)
    s.add(a)
    s.add(b)
    s.step()
    a.cancel()
    ended = s.step()
    assert [(f.run.name, str(f.error)) for f in ended] == [("a", "a cancelled after 1 of 4 steps")]
    assert a.closed and "a" in s.executor.dropped and s.executor.rounds[-1] == ["b"]
    assert [f.run.name for f in s.run_all()] == ["b"] and b.steps_done == 4


def test_a_failing_run_ends_alone_with_its_error():
    s = scheduler()
    bad, good = FakeRun("bad", steps=3, fail_at=1), FakeRun("good", steps=3)
    s.add(bad)
    s.add(good)
    ended = s.run_all()
    errors = {f.run.name: f.error for f in ended}
    assert isinstance(errors["bad"], RuntimeError) and errors["good"] is None
    assert good.steps_done == 3 and bad.closed


def test_a_run_whose_start_fails_is_reported_and_the_line_moves_on():
    s = scheduler()

    class Refused(FakeRun):
        def start(self):
            raise MemoryError("no room")
    s.add(Refused("r"))
    s.add(FakeRun("ok", steps=1))
    ended = s.run_all()
    assert [(f.run.name, type(f.error).__name__) for f in ended] == [("r", "MemoryError"), ("ok", "NoneType")]


def test_plan_hands_the_executor_every_running_call_whole():
    s = scheduler()
    for n in "ab":
        s.add(FakeRun(n))
    s.step()
    assert s.plan(s.running) == [Work(s.running[0]), Work(s.running[1])]


@pytest.mark.parametrize("steps", [1, 5])
def test_complete_raises_the_first_error_in_order(steps):
    s = scheduler()
    runs = [FakeRun("a", steps=steps), FakeRun("b", steps=2, fail_at=0), FakeRun("c", steps=1, fail_at=0)]
    with pytest.raises(RuntimeError, match="b failed"):
        s.complete(runs, pad=0)
    assert all(r.closed for r in runs)


def test_a_batchs_generation_combines_its_requests():
    import torch

    from mosaic.config import GenerationConfig
    from mosaic.engine.result import Generation, combine

    def gen(tokens, seq_len, nfe, steps, labels):
        stats = {"nfe": nfe, "nfe_per_row": [nfe], "nfe_per_token": nfe / 4, "kv_device_bytes": 100,
                 "accepted": {1: nfe}, "threshold": 0.9, "cache": "dual"}
        return Generation([f"t{nfe}"], torch.tensor([tokens]), torch.full((1, seq_len), 7), "planned", steps, 1.0,
                          10 * nfe, GenerationConfig(max_new_tokens=4), labels, stats, steps_run=steps)
    a, b = gen([1, 2, 3, 4], 6, 3, 3, ["x"]), gen([5, 6, 7, 8], 9, 5, 5, ["x", "y"])
    out = combine([a, b], 2.5, pad=0)
    assert out.texts == ["t3", "t5"] and out.tokens.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert out.sequences.shape == (2, 9) and out.sequences[0, :3].tolist() == [0, 0, 0]   # left-padded
    assert (out.steps, out.steps_run, out.seconds, out.peak_device_bytes) == (5, 5, 2.5, 50)
    assert out.lossy == ["x", "y"] and out.parts == [a, b]
    st = out.stats
    assert st["nfe"] == 5 and st["nfe_per_row"] == [3, 5] and st["kv_device_bytes"] == 200
    assert st["accepted"] == {1: 8} and st["threshold"] == 0.9 and st["nfe_per_token"] == 5 / 4
    assert combine([a], 9.0, pad=0).seconds == 9.0
