"""The engine's loop: who runs next, decided in one place.

A `Scheduler` owns the requests of one engine that are in flight: a waiting line and a running
batch of RequestRuns (engine/run.py, each suspended at its pending call). `step()` is one round:

  1. leave: a run that was cancelled (`cancel(run)`, or its caller's cancelled()) ends with
     RequestCancelled, waiting or running. This is the engine's one cancellation path: the same
     flag stops an eager step after its current op (runtime/runner.py);
  2. join: waiting runs start, first come first served, while `fits` says the running batch with
     the newcomer still fits: at most `max_seqs` sequences, and (under a budget) the Admitter
     (policy/admitter.py) admits one step of all of them at the longest length and the largest
     canvas, the stacked step's worst case. The first run that does not fit waits, and so does
     everyone behind it (no request overtakes another); running work is never evicted;
  3. run: `plan` chooses each running run's work for the round and the round executor runs it
     (engine/batching.RoundExecutor: `run_round(work) -> one outcome per item`, stacked where
     the step program allows). The executor decides nothing about who runs;
  4. update: outputs go back to their runs (each runs its sampler to its next call) and the runs
     that ended come back as Finished(run, generation, error).

generate() (a list of prompts is a batch of requests), `mosaic bench` and the server's worker
(serve/worker.py) drive it. The shape is nano-vllm's `LLMEngine.step` (schedule, run,
postprocess) and vLLM v1's `EngineCore.step` (SchedulerOutput -> executor -> update_from_output),
with the Admitter where vLLM has its KV-cache manager. A new policy (priorities, preemption,
another join rule) is this file: override `fits`, `plan` or `_join`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from .batching import RoundExecutor, Work
from .result import Generation, combine
from .run import RequestCancelled, RequestRun

MAX_SEQS = 256      # generate()'s batch: sequences running at once (a list of prompts joins in waves past it)


@dataclass
class Finished:
    """A run that ended in this round: its Generation, or the error that ended it."""
    run: RequestRun
    generation: Generation | None
    error: Exception | None


class Scheduler:
    """Waiting and running requests of one engine, and the rounds that run them (module
    docstring). max_seqs: the most sequences running at once."""

    def __init__(self, engine, max_seqs: int = MAX_SEQS, executor=None):
        self.engine, self.max_seqs = engine, max_seqs
        self.executor = executor if executor is not None else RoundExecutor(engine)
        self.waiting: deque[RequestRun] = deque()
        self.running: list[RequestRun] = []
        self.rounds = 0

    @property
    def stats(self):
        """The round executor's counters (steps, stacked steps, padding, fill slices)."""
        return self.executor.stats

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, run: RequestRun) -> None:
        """Queue a run (admitted, not started): it joins at a step boundary when it fits."""
        self.waiting.append(run)

    def cancel(self, run: RequestRun) -> None:
        """Stop a run, waiting or running (thread-safe): it ends with RequestCancelled at the next
        step, or after the op its eager step is running."""
        run.cancel()

    # -- one round
    def step(self) -> list[Finished]:
        """One round (module docstring): the runs that ended in it."""
        done = self._leave()
        done += self._join()
        if self.running:
            work = self.plan(self.running)
            outcomes = self.executor.run_round(work)
            done += self._update(work, outcomes)
            self.rounds += 1
        return done

    def run_all(self) -> list[Finished]:
        """Step until nothing waits or runs; every run that ended, in the order it ended."""
        out = []
        while self.has_work:
            out += self.step()
        return out

    def _leave(self) -> list[Finished]:
        done = []
        for run in [r for r in self.waiting if r.is_cancelled()]:
            self.waiting.remove(run)
            run.close()
            done.append(Finished(run, None, RequestCancelled(
                f"request cancelled before it started (0 of {run.total_steps} steps)")))
        for run in [r for r in self.running if r.is_cancelled()]:
            try:
                run.check_cancelled()
            except RequestCancelled as e:
                done.append(self._end(run, e))
        return done

    def _join(self) -> list[Finished]:
        """Waiting runs start, in order, while the batch with them still fits."""
        done = []
        while self.waiting and self.fits(self.waiting[0]):
            run = self.waiting.popleft()
            self.running.append(run)
            try:
                run.start()
            except Exception as e:  # noqa: BLE001  (the request's error, reported with it)
                done.append(self._end(run, e))
                continue
            if run.done:              # a sampler with nothing to run
                done.append(self._end(run))
        return done

    def fits(self, run: RequestRun) -> bool:
        """Whether `run` may join the running batch now: an empty batch takes what admission took;
        else at most max_seqs sequences, and under a budget the Admitter's answer for a step of
        every running sequence plus the newcomer's at the longest length and the largest canvas
        among them (the stacked step's worst case; the native path has no plan to check)."""
        if not self.running:
            return True
        reqs = [r.request for r in self.running] + [run.request]
        rows = sum(q.batch for q in reqs)
        if rows > self.max_seqs:
            return False
        if run.request.native or not self.engine.memory.has_budget:
            return True
        gen = max((q.gen for q in reqs), key=lambda g: g.max_new_tokens)
        return self.engine.admitter.fits(rows, max(q.length for q in reqs), gen)

    def plan(self, running: list[RequestRun]) -> list[Work]:
        """Each running run's work this round: its pending call, whole."""
        return [Work(r) for r in running]

    def _update(self, work: list[Work], outcomes: list) -> list[Finished]:
        done = []
        for w, out in zip(work, outcomes):
            run = w.run
            if out is None:                    # a slice of a fill: the call is not done yet
                continue
            if isinstance(out, Exception):
                done.append(self._end(run, out))
                continue
            try:
                run.advance(out)
            except Exception as e:  # noqa: BLE001
                done.append(self._end(run, e))
                continue
            if run.done:
                done.append(self._end(run))
        return done

    def _end(self, run: RequestRun, error: Exception | None = None) -> Finished:
        """A run leaves: the executor forgets it, its memory is released, its result made."""
        if run in self.running:
            self.running.remove(run)
        self.executor.drop(run)
        run.close()
        generation = None
        if error is None:
            try:
                generation = run.result()
            except Exception as e:  # noqa: BLE001
                error = e
        return Finished(run, generation, error)

    # -- generate()
    def complete(self, runs: list[RequestRun], pad: int) -> Generation:
        """Run `runs` (admitted, not started) to their end as one batch; their combined Generation
        (result.combine: `parts` holds each one's). Raises the first run's error, in order; every
        run is closed however this ends (Ctrl-C included)."""
        t0 = time.perf_counter()
        for run in runs:
            self.add(run)
        try:
            ended = {id(f.run): f for f in self.run_all()}
        finally:
            for run in runs:
                if not run.done:
                    run.close()
        for run in runs:
            if ended[id(run)].error is not None:
                raise ended[id(run)].error
        return combine([ended[id(r)].generation for r in runs], time.perf_counter() - t0, pad)

