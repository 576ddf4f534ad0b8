"""One engine worker thread, its queue and its running batch.

Each job carries the engine's Request and the Admission the server made before queueing it, so a
request is admitted once. The worker keeps a continuous batch (engine/batching.Batch): a job
joins at the next step boundary when the Admitter says the batch with it still fits the budget,
its sampler's steps run stacked with the others' where the step program allows (plain steps
with the same reducer; block steps of the same block length), and it leaves when it ends. Each
request draws its own random stream in its own row order, so on the CPU in float32 its tokens
equal its tokens alone; on a GPU, GEMMs over more rows may pick other kernels (bf16 near-ties can
differ: docs/SERVING.md). max_batch=1 runs one request at a time.

A job talks to its HTTP handler through `events` (put from this thread with the event loop's
call_soon_threadsafe): ("step", StepEvent) after every denoising step, then one ("done", JobResult)
or ("error", MosaicError/Exception). Cancelling a job (client gone) stops it before its next
step; the others go on."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import GenerationConfig
from ..engine import MosaicEngine, RequestCancelled
from ..engine.batching import Batch
from .stream import CommittedText, eos_ids, render_canvas

log = logging.getLogger("mosaic.serve")


class Cancelled(Exception):
    """Raised from on_step when the client went away: stops the engine between steps.
    steps_run: denoising steps done before it stopped (0: it never started)."""

    def __init__(self, message: str, steps_run: int = 0):
        super().__init__(message)
        self.steps_run = steps_run


@dataclass
class StepEvent:
    step: int          # 1-based denoising step just done
    steps: int         # total steps of this request
    masked: int        # masked positions before the step
    delta: str         # new committed text ("" when none)
    canvas: str | None = None   # the canvas preview (stream_canvas), masks as "_"


@dataclass
class JobResult:
    text: str
    finish_reason: str           # "stop" (end-of-text or a stop string) | "length"
    prompt_tokens: int
    completion_tokens: int       # generated tokens before the first end-of-text
    canvas_tokens: int           # max_new_tokens: the canvas length
    steps: int
    steps_run: int
    stopped_early: bool
    engine_seconds: float
    queue_seconds: float
    path: str
    lossy: list[str]
    seed: int | None
    token_ids: list[int]         # the answer's tokens (before end-of-text / the stop string)
    stats: dict = field(default_factory=dict)   # Generation.stats (Fast-dLLM: nfe, cache, ...)


_ids = itertools.count(1)


@dataclass
class Job:
    """One admitted request. emit(kind, payload) is called from the worker thread."""
    prompt_ids: list[int]
    gen: GenerationConfig
    emit: Callable[[str, object], None]
    stop: list[str] = field(default_factory=list)
    want_canvas: bool = False
    want_steps: bool = True      # emit a "step" event after every step (streaming requests)
    predicted_bytes: int | None = None
    admission_seconds: float = 0.0
    request: object = None       # the engine's Request (None: built here from prompt_ids and gen)
    admission: object = None     # its Admission, made when the server accepted it
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    def mark_started(self) -> float:
        """The worker starts running it now (queue time ends); returns the time."""
        self.started = time.perf_counter()
        return self.started


@dataclass
class Active:
    """A job in the running batch: its RequestRun and the committed text its stream follows."""
    job: Job
    run: object
    text: CommittedText
    steps: int
    ran: list = field(default_factory=lambda: [0])


class EngineWorker:
    """Runs jobs on one thread as a continuous batch (engine/batching.py): a job joins the running
    batch at the next step boundary when the Admitter says the batch with it still fits the
    budget (else it waits, first come first served: running work is never evicted) and leaves
    when its sampler ends, it stops early or its client goes away. on_finish(job, result|None,
    error|None) reports each job (metrics). max_queue: jobs waiting before submit() refuses;
    max_batch: the most sequences in the batch (1: one request at a time)."""

    def __init__(self, engine: MosaicEngine, max_queue: int = 256, on_finish=None, max_batch: int = 16):
        self.engine = engine
        self.max_queue, self.max_batch = max_queue, max_batch
        self.on_finish = on_finish or (lambda job, result, error: None)
        self.queue: queue.Queue = queue.Queue()
        self.batch = Batch(engine, max_rows=max_batch)
        self.waiting: deque[Active] = deque()
        self.active: dict[int, Active] = {}       # id(run) -> the job it runs
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="mosaic-engine", daemon=True)
        self.thread.start()

    @property
    def running(self) -> Job | None:
        """One job of the running batch (None: nothing runs)."""
        return next(iter(self.active.values())).job if self.active else None

    @property
    def length(self) -> int:
        """Jobs waiting plus the ones running."""
        return self.queue.qsize() + len(self.waiting) + len(self.active)

    def submit(self, job: Job) -> bool:
        """Queue an admitted job; False when the queue is full."""
        if self.queue.qsize() + len(self.waiting) >= self.max_queue:
            return False
        self.queue.put(job)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Cancel what runs, drain the queue and stop the thread."""
        for a in list(self.active.values()) + list(self.waiting):
            a.job.cancel()
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit("error", Cancelled("the server is shutting down"))
        self.queue.put(None)
        self.thread.join(timeout)

    # -- the loop
    def _loop(self) -> None:
        while not self.stopping:
            self._take(block=not self.active and not self.waiting)
            self._join()
            if self.active:
                self._step()
        for a in list(self.active.values()) + list(self.waiting):
            self._finish(a.job, None, Cancelled("the server is shutting down"))

    def _take(self, block: bool) -> None:
        """Jobs from the queue into the waiting line (blocking only when nothing else is to do)."""
        try:
            job = self.queue.get(timeout=None) if block else self.queue.get_nowait()
        except queue.Empty:
            return
        while True:
            if job is None:
                self.stopping = True
                return
            if job.cancelled.is_set():
                self._finish(job, None, Cancelled("the client went away before the request started"))
            else:
                try:
                    self.waiting.append(self._prepare(job))
                except Exception as e:  # noqa: BLE001  (reported to its request)
                    self._finish(job, None, e)
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return

    def _join(self) -> None:
        """Waiting jobs join the batch, in order, while it still fits."""
        while self.waiting and not self.stopping:
            a = self.waiting[0]
            if a.job.cancelled.is_set():
                self.waiting.popleft()
                self._finish(a.job, None, Cancelled("the client went away before the request started"))
                continue
            if not self.batch.fits(a.run):
                return
            self.waiting.popleft()
            a.job.mark_started()
            try:
                self.batch.add(a.run)
                self.active[id(a.run)] = a
            except Exception as e:  # noqa: BLE001
                a.run.close()
                self._finish(a.job, None, e)

    def _step(self) -> None:
        for run, err in self.batch.step():
            a = self.active.pop(id(run))
            if err is not None:
                if not isinstance(err, Cancelled | RequestCancelled):
                    log.error("request %s failed: %s: %s", a.job.id, type(err).__name__, err)
                self._finish(a.job, None, _as_cancelled(err, a))
                continue
            run.close()
            try:
                self._finish(a.job, self._result(a, run.result()), None)
            except Exception as e:  # noqa: BLE001
                self._finish(a.job, None, e)

    def _finish(self, job, result, error) -> None:
        try:
            self.on_finish(job, result, error)
        finally:
            job.emit("error" if error is not None else "done", error if error is not None else result)

    # -- one job
    def _prepare(self, job: Job) -> Active:
        """The job's RequestRun (not started: nothing allocated until it joins the batch), with
        its stream: committed text sent after every step."""
        engine, gen = self.engine, job.gen
        cfg = engine.model.cfg
        P = len(job.prompt_ids)
        steps = engine.sampler.total_steps(gen)
        text = CommittedText(engine.decode, eos_ids(cfg), cfg.mask_id, list(job.stop))
        ran = [0]

        def on_step(i: int, canvas: torch.Tensor) -> bool:
            ran[0] = i
            gen_ids = canvas[0, P:].cpu()
            masked = int((gen_ids == cfg.mask_id).sum())
            delta = text.update(gen_ids, final=masked == 0)
            if job.want_steps:
                preview = render_canvas(_piece(engine), gen_ids.tolist(), cfg.mask_id) if job.want_canvas else None
                job.emit("step", StepEvent(i, steps, masked, delta, preview))
            if job.cancelled.is_set():
                raise Cancelled(f"request {job.id} cancelled after step {i} of {steps}", i)
            return bool(text.done and masked)   # the committed prefix ends the answer: stop here

        request = job.request if job.request is not None else engine.request([job.prompt_ids], config=gen)
        run = engine.start(request, admission=job.admission, on_step=on_step, progress=False,
                           cancelled=job.cancelled.is_set)
        return Active(job, run, text, steps, ran)

    def _result(self, a: Active, out) -> JobResult:
        job, text, gen = a.job, a.text, a.job.gen
        P, G = len(job.prompt_ids), gen.max_new_tokens
        seconds = time.perf_counter() - job.started
        if not text.done:   # every step ran: the canvas is complete
            raise RuntimeError(f"request {job.id}: the sampler ended with masked positions left")
        # a constrained answer that fills the canvas in an accepting state is complete, not cut
        finish = "stop" if (out.stats.get("structured") or {}).get("complete") else text.done
        return JobResult(text.text, finish, P, text.answer_tokens if text.answer_tokens is not None else G, G,
                         a.steps, a.ran[0], out.stopped_early, seconds, job.started - job.submitted, out.path,
                         out.lossy, gen.seed, list(text.answer_ids or []), out.stats)


def _as_cancelled(err: Exception, a: Active) -> Exception:
    """The engine's RequestCancelled as the server's Cancelled (with the steps that ran)."""
    if isinstance(err, RequestCancelled):
        return Cancelled(f"request {a.job.id} cancelled after step {a.ran[0]} of {a.steps}", a.ran[0])
    return err


def _piece(engine):
    tok = engine.model.tokenizer
    if tok is None:
        return lambda ids: " ".join(map(str, ids)) + " "
    return lambda ids: tok.decode(ids, skip_special_tokens=False)
