"""The engine's loop: who runs next, decided in one place.

A `Scheduler` owns the requests of one engine that are in flight: a waiting line and a running
batch of RequestRuns (engine/run.py, each suspended at its pending call). `step()` is one round:

  1. leave: a run that was cancelled (`cancel(run)`, or its caller's cancelled()) ends with
     RequestCancelled, waiting or running. This is the engine's one cancellation path: the same
     flag stops an eager step after its current op (runtime/runner.py);
  2. join: waiting runs start, first come first served, while `fits` says the running batch with
     the newcomer still fits: at most `max_seqs` sequences, and (under a budget) the Admitter
     (policy/admitter.py) admits one step of all of them at the longest length and the largest
     canvas, the stacked step's worst case, with what the K/V pool holds beyond that charge
     while the newcomer's store is made (old + grown buffers during the copy, idle buffers kept
     for the next request: engine/batch_memory.py, memory/kv_pool.py peak_bytes; idle buffers a join
     needs are given back first). The first run that does not fit waits, and so does
     everyone behind it (no request overtakes another); running work is never evicted;
  3. run: `plan` chooses each running run's work for the round (its pending call whole, or a
     slice of the layers of its fill: chunked joining, below) and the round executor runs it
     (engine/batching.RoundExecutor: `run_round(work) -> one outcome per item`, stacked where
     the step program allows). The executor decides nothing about who runs;
  4. update: outputs go back to their runs (each runs its sampler to its next call) and the runs
     that ended come back as Finished(run, generation, error).

generate() (a list of prompts is a batch of requests), `mosaic bench` and the server's worker
(serve/worker.py) drive it. The shape is nano-vllm's `LLMEngine.step` (schedule, run,
postprocess) and vLLM v1's `EngineCore.step` (SchedulerOutput -> executor -> update_from_output),
with the Admitter where vLLM has its KV-cache manager. A new policy (priorities, preemption,
another join rule) is this file: override `fits`, `plan` or `_join`.

Chunked joining (`round_tokens`, like vLLM's max_num_batched_tokens). A block cache's fill (the
full forward that fills a Fast-dLLM request's store: its prompt's K/V when it joins, the whole
canvas at each dual-cache block) costs the whole sequence through every layer, while a block step
costs its block. Running a 1k-token fill inside a round of 16 block steps of 32 rows stalls them
all for it. With a budget of `round_tokens` tokens per round, the running runs' other work is
charged first (B x rows of each step: it is never held back), and each fill, oldest first, gets
what is left, and at least `round_tokens / 2` (and one layer) whatever is left, so that every fill
advances every round: a fill of N tokens that does not fit runs as slices of its layers, a slice
of k of the model's num_layers layers costing N x k / num_layers tokens (engine/fills.py). The
floor is per fill because a request whose fill waits does nothing at all, and fills are not rare:
a dual cache refills at every block, which at one token per forward costs about what the block's
steps cost (a 1k prompt + 128: a 1,152-token refill per 32 steps of 32 rows = 1,024 tokens). At
64 running requests their block steps alone take 2,048 tokens a round; under a floor shared by
all fills (the oldest's) the refills would fall behind until only about 30 of the 64 decoded.
The round then costs the others' steps plus at most max(round_tokens, fills x round_tokens / 2)
tokens of fills: the fills in flight bound how long a round can hold the others up. Attention is
bidirectional, so a fill cannot be split by positions (every position of layer l needs every
position of layer l - 1); split by layers it is the same ops on the same values, so the tokens
are the unchunked fill's (tests/engine/test_chunked_join.py). Fills with nobody else in the
round, and fills that cannot be sliced (engine/fills.py `can_slice`), run whole (a fill already
begun runs its remaining layers).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from . import batch_memory as BM
from .batching import RoundExecutor, Work
from .fills import can_slice, fill_tokens
from .result import Generation, combine
from .run import RequestCancelled, RequestRun, progress_bar

MAX_SEQS = 256      # generate()'s batch: sequences running at once (a list of prompts joins in waves past it)


@dataclass
class Finished:
    """A run that ended in this round: its Generation, or the error that ended it."""
    run: RequestRun
    generation: Generation | None
    error: Exception | None


class Scheduler:
    """Waiting and running requests of one engine, and the rounds that run them (module
    docstring). max_seqs: the most sequences running at once; round_tokens: the tokens a round
    may put through the model before fills are sliced (default: the engine's
    EngineConfig.round_tokens; None there: fills run whole). Raises ValueError for round_tokens < 1."""

    def __init__(self, engine, max_seqs: int = MAX_SEQS, round_tokens: int | None = None, executor=None):
        if round_tokens is None:
            round_tokens = getattr(getattr(engine, "config", None), "round_tokens", None)
        if round_tokens is not None and (isinstance(round_tokens, bool) or round_tokens < 1):
            raise ValueError(f"round_tokens must be a positive number of tokens, got {round_tokens!r}")
        self.engine, self.max_seqs, self.round_tokens = engine, max_seqs, round_tokens
        self.executor = executor if executor is not None else RoundExecutor(engine)
        self.waiting: deque[RequestRun] = deque()
        self.running: list[RequestRun] = []
        self.fill_done: dict[int, int] = {}     # id(run) -> layers of its pending fill already run
        self._changed = False                    # the running batch changed since its graphs were charged
        self.rounds = 0
        self.round_seconds = 0.0                 # wall time inside rounds (run + update)
        self.round_tokens_run = 0                # tokens the rounds put through the model

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
            if self._changed:           # its graphs held under its stacked step's charge
                self._changed = False
                BM.hold_graphs(self.engine, self.running)
            t0 = time.perf_counter()
            work = self.plan(self.running)
            self.round_tokens_run += sum(self._work_tokens(w) for w in work)
            outcomes = self.executor.run_round(work)
            done += self._update(work, outcomes)
            self.rounds += 1
            self.round_seconds += time.perf_counter() - t0
        return done

    def _work_tokens(self, w: Work) -> float:
        if w.layers is None:
            return _tokens(w.run)
        return fill_tokens(w.run) * (w.layers[1] - w.layers[0]) / self.engine.model.cfg.num_layers

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
            self._changed = True
            try:
                run.start()
            except Exception as e:  # noqa: BLE001  (the request's error, reported with it)
                done.append(self._end(run, e))
                continue
            if run.done:              # a sampler with nothing to run
                done.append(self._end(run))
        return done

    def fits(self, run: RequestRun) -> bool:
        """Whether `run` may join the running batch now: an empty batch takes what admission took
        (idle K/V pool buffers it has no room for are given back as it starts: engine/run.py);
        else at most max_seqs sequences, and under a budget the Admitter's answer for a step of
        every running sequence plus the newcomer's at the longest length and the largest canvas
        among them (the stacked step's worst case; the native path has no plan to check), asked
        again after the pool's idle buffers are given back where no store is alive and the
        answer was no (a join never waits for idle capacity: memory/kv_pool.py trim)."""
        if not self.running:
            return True
        reqs = [r.request for r in self.running] + [run.request]
        rows = sum(q.batch for q in reqs)
        if rows > self.max_seqs:
            return False
        if run.request.native or not self.engine.memory.has_budget:
            return True
        if BM.admits(self.engine, run, reqs, rows):
            return True
        pool = BM.pool_of(self.engine)
        return pool is not None and pool.trim() > 0 and BM.admits(self.engine, run, reqs, rows)

    def plan(self, running: list[RequestRun]) -> list[Work]:
        """Each running run's work this round: its pending call whole, except fills that share the
        round with other work under `round_tokens` (module docstring): they get slices of their
        layers, oldest first, from what the others' calls leave of the budget and at least
        half the budget each."""
        fills = [r for r in running if can_slice(self.engine, r)] if self.round_tokens is not None else []
        if not fills:
            return [Work(r) for r in running]
        others = [r for r in running if r not in fills]
        work = [Work(r) for r in others]
        left = float("inf") if not others else self.round_tokens - sum(_tokens(r) for r in others)
        for run in fills:        # running is in join order: oldest first
            share = max(left, self.round_tokens / 2)
            a, b = self._slice(run, share)
            left -= fill_tokens(run) * (b - a) / self.engine.model.cfg.num_layers
            work.append(Work(run) if b - a == self.engine.model.cfg.num_layers else Work(run, (a, b)))
        return work

    def _slice(self, run: RequestRun, share: float) -> tuple[int, int]:
        """The layers [a, b) of run's pending fill that `share` tokens pay for, from where it
        stands (at least one layer)."""
        num_layers = self.engine.model.cfg.num_layers
        a = self.fill_done.get(id(run), 0)
        per_layer = fill_tokens(run) / num_layers
        k = num_layers - a if share == float("inf") else min(num_layers - a, int(share // per_layer))
        k = max(k, 1)
        if a + k < num_layers:
            self.fill_done[id(run)] = a + k
        return a, a + k

    def _update(self, work: list[Work], outcomes: list) -> list[Finished]:
        done = []
        for w, out in zip(work, outcomes):
            run = w.run
            if out is None:                    # a slice of a fill: the call is not done yet
                continue
            self.fill_done.pop(id(run), None)
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
            self._changed = True
        self.fill_done.pop(id(run), None)
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
    def complete(self, runs: list[RequestRun], pad: int, progress: bool = False) -> Generation:
        """Run `runs` (admitted, not started) to their end as one batch; their combined Generation
        (result.combine: `parts` holds each one's). progress: a bar of the requests finished.
        Raises the first run's error, in order; every run is closed however this ends (Ctrl-C
        included)."""
        for run in runs:
            self.add(run)
        bar = progress_bar(len(runs), progress, "requests", "request")
        ended: dict[int, Finished] = {}
        try:
            while self.has_work:
                for f in self.step():
                    ended[id(f.run)] = f
                    if bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for run in runs:
                if not run.done:
                    run.close()
        for run in runs:
            if ended[id(run)].error is not None:
                raise ended[id(run)].error
        # the batch's wall time: from its first start to its last finish (each run's seconds stop
        # at its sampler's end, after a device sync, before its result is decoded)
        seconds = max(r.started_at + r.seconds for r in runs) - min(r.started_at for r in runs)
        return combine([ended[id(r)].generation for r in runs], seconds, pad)



def _tokens(run: RequestRun) -> int:
    """Tokens a run's pending call puts through the model: the canvas rows that run (B x n)."""
    call = run.pending
    ids = getattr(call, "ids", None)
    if ids is None:          # a block-diffusion call runs columns [a, hi) of every row
        return run.request.batch * (call.hi - call.a) if hasattr(call, "hi") else 0
    cache = getattr(call, "cache", None)
    if cache is not None and cache.mode == "block":
        return int(ids.shape[0] * (cache.hi - cache.lo))
    return int(ids.numel())
