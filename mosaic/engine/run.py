"""One request in flight: its canvas, random stream, block store, sampler coroutine and
statistics, from admission to its Generation.

A `RequestRun` owns everything that belongs to one request and nothing of the engine's: the
engine's Executor runs the calls its sampler yields, its DeviceMemory sets the budget's guard
around it. A scheduler can hold many RequestRuns at once: each is suspended at `pending`, the
next call its sampler wants executed; `advance(outputs)` sends the outputs back and runs the
sampler up to its next call (or its end).

on_step(step, canvas [B, L]) is called after every denoising step; returning True stops the
request there (the committed prefix already ends the answer: Generation.stopped_early), and an
exception it raises propagates. Cancellation has one path: `cancel()` (the Scheduler's, thread-
safe) or the caller's `cancelled()` make `is_cancelled()` true; it is asked before every call and
after every op of an eager step, and raises RequestCancelled there."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch

from ..errors import MosaicError, StepInterrupted
from ..memory.kv_store import KVStore, StoreLayout
from ..policy.features import lossy_labels
from ..policy.offload import mode_of
from ..runtime.published import clear_checks, restore_checks, settle_checks, take_checks
from ..runtime.samplers.base import StepDone
from ..runtime.samplers.constraint import CanvasConstraint
from .request import Request
from .result import Generation, fast_stats, graph_stats
from .steps import Executor, RowsState


class RequestCancelled(MosaicError):
    """The request was cancelled before it finished (its memory is released)."""


class RequestRun:
    """One request's run (module docstring). admission: its policy.admission.Admission (None:
    the native path, nothing planned)."""

    def __init__(self, request: Request, executor: Executor, memory, requests, admission=None, *,
                 on_step=None, probe=None, progress: bool = False, cancelled=None):
        self.request, self.executor, self.memory, self.requests = request, executor, memory, requests
        self.admission = admission
        self.on_step, self.cancelled = on_step, cancelled
        self.cancel_event = threading.Event()      # set by cancel(), from any thread
        self.held_checks: list = []                 # its call's NaN tests while others run (hold_checks)
        self.total_steps = request.sampler.max_steps(request.gen) if request.sampler.accelerated \
            else request.sampler.total_steps(request.gen)
        self.probe, self.progress = probe, progress
        self.x = self.prompt_len = self.generator = self.state = self.loop = self.constraint = None
        self.steps_done = 0
        self.pending = None
        self.loop_stats: dict | None = None
        self.stopped_early = False
        self.bar = None
        self.seconds = 0.0
        self.started_at: float | None = None      # perf_counter() when it started (joined a batch)
        self._graphs0 = None          # the engine's graph counters at the start (Generation.stats)

    def _make(self) -> None:
        """The request's tensors (after the guard is set: they are made under its cap): canvas,
        random stream, block store, and the sampler's coroutine."""
        request, executor = self.request, self.executor
        gen, sampler, model = request.gen, request.sampler, executor.model
        canvas = self.requests.canvas(request.prompts, gen.max_new_tokens, request.width)
        self.x, self.prompt_len = canvas.ids, canvas.prompt_len
        self.generator = None if gen.seed is None else torch.Generator(device=model.device).manual_seed(gen.seed)
        adm = self.admission
        store = make_store(model, executor.config, *self.x.shape, adm, executor.kv_pool) \
            if sampler.uses_cache(gen) and not request.native else None
        pads = tuple(canvas.prompt_len - len(p) for p in request.prompts) if canvas.valid is not None else None
        self.state = RowsState(canvas.valid, store, adm.offload if adm is not None else None, self.probe,
                               interrupt=cancel_check(self.cancel_event, self.cancelled), deferred=True, pads=pads)
        B, P, G = self.x.shape[0], self.prompt_len, gen.max_new_tokens
        self.constraint = constraint_for(request, model.cfg, [(P, P + G)] * B)
        predict = sampler.predictor(gen, self.generator, canvas.valid, request.native, model.dtype, self.constraint)
        self.loop = sampler.loop(predict, self.x, self.prompt_len, gen, self.generator)
        self.bar = progress_bar(self.total_steps, self.progress)

    @property
    def done(self) -> bool:
        return self.loop_stats is not None

    # -- stepping
    def start(self) -> None:
        """Set the budget's guard for this request and run its sampler up to its first call."""
        dev = self.executor.model.device
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        self.started_at = time.perf_counter()
        clear_checks()                        # nothing left over from another request on this thread
        # idle K/V pool buffers (no store alive) are kept only where this request's admission
        # leaves room for them, else given back before anything of it exists (memory/kv_pool.py)
        held = idle_pool_beyond(getattr(self.executor, "kv_pool", None), self.admission)
        if not self.request.native:
            self.memory.begin(self.admission, held, owner=self)
            g = getattr(self.memory, "graphs", None)
            self._graphs0 = g.stats.snapshot() if g is not None else None
        self._make()
        self._resume(lambda: next(self.loop))

    def advance(self, outputs) -> None:
        """Send the pending call's outputs back and run the sampler up to its next call (with the
        NaN tests its call left, held since: hold_checks)."""
        restore_checks(self.held_checks)
        self.held_checks = []
        self._resume(lambda: self.loop.send(outputs))

    def hold_checks(self, checks: list | None = None) -> None:
        """Keep the NaN tests the call just run left on this thread (runtime/published.py) with
        this run until advance(): the round executor runs other requests' calls in between.
        checks: [(0-d bool device tensor, dtype)], the run's own tests of a stacked step
        (engine/batching.py), held instead of the thread's."""
        self.held_checks += take_checks() if checks is None else checks

    def _resume(self, step) -> None:
        try:
            event = step()
            while isinstance(event, StepDone):
                settle_checks()               # read already when the sampler read back its commit
                if self._step_done(event.masked):
                    self.stopped_early = True
                    self.loop.close()
                    self._finish({})
                    return
                event = self.loop.send(None)
        except StopIteration as stop:
            settle_checks()
            self._finish(stop.value or {})
            return
        self.pending = event

    def _step_done(self, masked: int) -> bool:
        self.steps_done += 1
        if self.bar is not None:
            self.bar.set_postfix(masked=masked)
            self.bar.update(1)
        return bool(self.on_step(self.steps_done, self.x)) if self.on_step is not None else False

    def _finish(self, stats: dict) -> None:
        self.pending, self.loop_stats = None, stats
        self._release_store()
        dev = self.executor.model.device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.seconds = time.perf_counter() - self.started_at

    def cancel(self) -> None:
        """Ask the run to stop (thread-safe): it stops before its next call, or after the op its
        eager step is running (Scheduler.cancel is the one caller in the engine)."""
        self.cancel_event.set()

    def is_cancelled(self) -> bool:
        return cancel_check(self.cancel_event, self.cancelled)()

    def check_cancelled(self) -> None:
        """RequestCancelled when the run was cancelled (cancel(), or the caller's cancelled())."""
        if self.is_cancelled():
            raise RequestCancelled(f"request cancelled after {self.steps_done} of {self.total_steps} steps")

    def execute_pending(self):
        """The outputs of the pending call, run with this request's own state (not yet sent
        back: advance() does that). RequestCancelled if it was cancelled before or during it."""
        self.check_cancelled()
        with self.interruptible():
            return self.executor(self.pending, self.state)

    def run_pending(self) -> None:
        """Execute the pending call with this request's state and advance."""
        self.advance(self.execute_pending())

    @contextmanager
    def interruptible(self):
        """A step interrupted between two ops (cancelled() became true inside it) as RequestCancelled."""
        try:
            yield
        except StepInterrupted as e:
            raise RequestCancelled(f"request cancelled during step {self.steps_done + 1} of {self.total_steps} "
                                   f"({e})") from None

    def run(self) -> Generation:
        """The whole request: start, every call, then its Generation. The guard is lifted and
        the progress bar closed however it ends."""
        try:
            self.start()
            while not self.done:
                self.run_pending()
        finally:
            self.close()
        return self.result()

    def _release_store(self) -> None:
        """A pooled store's pages go back as soon as the sampler is done with them."""
        if self.state is not None and self.state.store is not None:
            self.state.store.close()

    def close(self) -> None:
        """Lift the budget's cap, give the store's pages back and drop the sampler (a cancelled
        run's canvas goes with it)."""
        self.memory.end(owner=self)
        self._release_store()
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if not self.done and self.loop is not None:
            self.loop.close()

    def result(self) -> Generation:
        req, model = self.request, self.executor.model
        gen, sampler = req.gen, req.sampler
        tokens = self.x[:, self.prompt_len:].cpu()
        texts = [self.requests.decode(t) for t in tokens]
        offload = self.state.offload
        store = self.state.store
        lossy = lossy_labels(self.requests.setting(req), model, sampler, offload,
                             store.readers if store is not None else ())
        stats = fast_stats(gen, self.loop_stats or {}, self.state.store, self.steps_done) if sampler.accelerated \
            else dict(self.loop_stats or {})   # the self-speculative loop's nfe and acceptance
        if self.constraint is not None:
            lossy.append(self.constraint.label)
            stats["structured"] = constraint_stats(self.constraint) | {"unenforced": req.constraint.unenforced()}
        adm = self.admission
        graphs = graph_stats(getattr(self.memory, "graphs", None), self._graphs0, adm)
        if graphs is not None:
            stats["graphs"] = graphs
        return Generation(texts, tokens, self.x.cpu(), "native" if req.native else "planned",
                          self.steps_done if sampler.accelerated else self.total_steps,
                          self.seconds, self.memory.peak_device_bytes(), gen, lossy, stats, mode_of(offload),
                          list(model.precision), adm.predicted_bytes if adm is not None else None,
                          self.stopped_early, self.steps_done,
                          beyond_trained_length=req.beyond_trained_length)


def constraint_for(request: Request, mcfg, spans: list[tuple[int, int]]) -> CanvasConstraint | None:
    """The request's output constraint over its answer columns `spans` (None: free text)."""
    if request.grammar is None:
        return None
    return CanvasConstraint(request.grammar, spans, mcfg.mask_id, (mcfg.eos_id, *mcfg.extra_eos_ids),
                            request.constraint.label())


def constraint_stats(c: CanvasConstraint) -> dict:
    """What a constrained run reports: rows re-reduced under a mask, whether every answer reached an
    accepting state (result() adds `unenforced`: the schema keywords the grammar does not enforce)."""
    return {"rows_masked": c.positions_masked, "complete": c.complete()}


def make_store(model, config, batch: int, length: int, admission=None, pool=None):
    """A block cache's store of batch x length tokens laid out as admission chose (every layer on
    the device when nothing was admitted, or kv_tier='host': every layer on the host); a
    device-tier store lives in the engine's paged pool when it has one (memory/kv_pool.py)."""
    layout = admission.layout if admission is not None else None
    if layout is None or (layout.batch, layout.length) != (batch, length):
        hot = 0 if config.kv_tier == "host" else None
        layout = StoreLayout.of(model.cfg, batch, length, model.dtype.itemsize, hot)
    if pool is not None and layout.hot >= layout.num_layers:
        return pool.store(layout)
    return KVStore(layout, model.device, model.dtype)


def idle_pool_beyond(pool, admission) -> int:
    """At a request's start: the bytes the engine's K/V pool keeps beyond the request's own store
    (0 for one that keeps its store elsewhere) out of idle buffers (no store alive; under a
    budget only), where its admission leaves room for them; else they are given back now
    (KVPool.reuse_or_trim) and 0 is returned. A request admitted with nothing planned (native)
    leaves no known room: the idle buffers go."""
    if pool is None:
        return 0
    lay = getattr(admission, "layout", None)
    rows = lay.rows if lay is not None and lay.hot >= lay.num_layers else 0
    budget = getattr(admission, "budget_bytes", None)
    room = None if budget is None else budget - admission.predicted_bytes
    return pool.reuse_or_trim(rows, room)


def cancel_check(event: threading.Event, cancelled=None):
    """is_cancelled() without a reference to the run (its state holds it: a run -> state -> run
    cycle kept a dropped engine's executor and model alive until the cyclic collector ran)."""
    return lambda: event.is_set() or (cancelled is not None and bool(cancelled()))


def progress_bar(total: int, enabled: bool, desc: str = "denoising", unit: str = "step"):
    if not enabled:
        return None
    from tqdm.auto import tqdm  # noqa: PLC0415  (tqdm is only imported when a bar is shown)
    return tqdm(total=total, desc=desc, unit=unit, leave=False)
