"""The engine worker: one thread, a queue and an event stream over the engine's Scheduler.

Each job carries the engine's Request and the Admission the server made before queueing it, so a
request is admitted once. The worker thread takes jobs from the queue, hands their RequestRuns
to its Scheduler (engine/scheduler.py, which decides who runs: first come first served, joins
while the Admitter says the batch fits, stacked steps, never evicting) and steps it while it has
work, reporting what finished. Everything the response says about the run (steps, steps_run,
stopped_early, lossy, stats) is read from the run's Generation. Each request draws its own
random stream, so on the CPU in float32 (and with batch_invariant on a GPU) its tokens equal its
tokens alone (docs/SERVING.md). max_batch=1 runs one request at a time.

A job talks to its HTTP handler through `events` (put from this thread with the event loop's
call_soon_threadsafe): ("step", StepEvent) after every denoising step, then one ("done", JobResult)
or ("error", MosaicError/Exception). Cancelling a job (client gone, timeout, shutdown) sets the
flag its run reads: the Scheduler ends it (waiting, or after the op its step is running) with
RequestCancelled, reported as Cancelled; that is the only cancellation path. The others go on."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import GenerationConfig
from ..engine import MosaicEngine, RequestCancelled
from ..engine.scheduler import Finished, Scheduler
from .canvas_reader import CanvasReader
from .stream import CommittedText, eos_ids, render_canvas

log = logging.getLogger("mosaic.serve")


class Cancelled(Exception):
    """A job that was cancelled (client gone, timeout, shutdown), as its handler sees it.
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
    stop_reason: str | int | None = None        # the stop string or stop token id that ended it


_ids = itertools.count(1)


@dataclass
class Job:
    """One admitted request. emit(kind, payload) is called from the worker thread."""
    prompt_ids: list[int]
    gen: GenerationConfig
    emit: Callable[[str, object], None]
    stop: list[str] = field(default_factory=list)
    stop_ids: tuple[int, ...] = ()   # vLLM's stop_token_ids
    want_canvas: bool = False
    want_steps: bool = True      # emit a "step" event after every step (streaming requests)
    predicted_bytes: int | None = None
    admission_seconds: float = 0.0
    request: object = None       # the engine's Request (None: built here from prompt_ids and gen)
    admission: object = None     # its Admission, made when the server accepted it
    id: int = field(default_factory=lambda: next(_ids))
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Thread-safe: its run (waiting or running) ends cancelled at the Scheduler's next step."""
        self.cancelled.set()


@dataclass
class Active:
    """A job handed to the Scheduler: its RequestRun and the committed text its stream follows."""
    job: Job
    run: object
    text: CommittedText
    tail: Callable[[], bool] = lambda: False   # streams the last step a lagged reader holds


class EngineWorker:
    """Runs jobs on one thread over a Scheduler (module docstring). on_finish(job, result|None,
    error|None) reports each job (metrics). max_queue: jobs waiting (not running) before submit()
    refuses; max_batch: the most sequences running at once (1: one request at a time)."""

    def __init__(self, engine: MosaicEngine, max_queue: int = 256, on_finish=None, max_batch: int = 16):
        self.engine = engine
        self.max_queue, self.max_batch = max_queue, max_batch
        self.on_finish = on_finish or (lambda job, result, error: None)
        self.queue: queue.Queue = queue.Queue()
        self.scheduler = Scheduler(engine, max_seqs=max_batch)
        self.jobs: dict[int, Active] = {}       # id(run) -> its job, from the queue until it is reported
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="mosaic-engine", daemon=True)
        self.thread.start()

    @property
    def running(self) -> Job | None:
        """One job of the running batch (None: nothing runs)."""
        runs = list(self.scheduler.running)
        a = self.jobs.get(id(runs[0])) if runs else None
        return a.job if a is not None else None

    @property
    def length(self) -> int:
        """Jobs waiting plus the ones running."""
        return self.queue.qsize() + len(self.scheduler)

    def submit(self, job: Job) -> bool:
        """Queue an admitted job; False when the queue is full."""
        if self.queue.qsize() + len(self.scheduler.waiting) >= self.max_queue:
            return False
        self.queue.put(job)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Cancel what runs, drain the queue and stop the thread."""
        for a in list(self.jobs.values()):
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
        self.engine.memory.enter_thread()    # this thread's BLAS handles, outside any step's pool
        while not self.stopping:
            self._take(block=not self.scheduler.has_work)
            if self.scheduler.has_work and not self.stopping:
                self._report(self.scheduler.step())
        for a in list(self.jobs.values()):      # shutdown: what is left ends cancelled
            a.job.cancel()
        while self.scheduler.has_work:
            self._report(self.scheduler.step())

    def _take(self, block: bool) -> None:
        """Jobs from the queue to the Scheduler (blocking only when it has nothing to do)."""
        try:
            job = self.queue.get(timeout=None) if block else self.queue.get_nowait()
        except queue.Empty:
            return
        while True:
            if job is None:
                self.stopping = True
                return
            try:
                a = self._prepare(job)
            except Exception as e:  # noqa: BLE001  (reported to its request)
                self._finish(job, None, e)
            else:
                self.jobs[id(a.run)] = a
                self.scheduler.add(a.run)
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return

    def _report(self, finished: list[Finished]) -> None:
        for f in finished:
            a = self.jobs.pop(id(f.run))
            if f.error is not None:
                if not isinstance(f.error, RequestCancelled):
                    log.error("request %s failed: %s: %s", a.job.id, type(f.error).__name__, f.error)
                self._finish(a.job, None, _as_cancelled(f.error, a))
                continue
            try:
                self._finish(a.job, self._result(a, f.generation), None)
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
        its stream: committed text sent after every step. Its cancellation flag is the job's."""
        engine = self.engine
        cfg = engine.model.cfg
        P = len(job.prompt_ids)
        text = CommittedText(engine.decode, eos_ids(cfg), cfg.mask_id, list(job.stop), job.stop_ids)
        total = [0]        # the run's total steps (an int, not the run: no run -> on_step -> run cycle)

        reader = CanvasReader(P)

        def on_step(i: int, canvas: torch.Tensor) -> bool:
            got = reader.push(i, canvas)         # on CUDA: the previous step's ids (canvas_reader.py)
            return False if got is None else follow(*got)

        def follow(i: int, gen_ids: torch.Tensor) -> bool:
            masked = int((gen_ids == cfg.mask_id).sum())
            delta = text.update(gen_ids, final=masked == 0)
            if job.want_steps:
                preview = render_canvas(_piece(engine), gen_ids.tolist(), cfg.mask_id) if job.want_canvas else None
                job.emit("step", StepEvent(i, total[0], masked, delta, preview))
            return bool(text.done and masked)   # the committed prefix ends the answer: stop here

        request = job.request if job.request is not None else engine.request([job.prompt_ids], config=job.gen)
        run = engine.start(request, admission=job.admission, on_step=on_step, progress=False,
                           cancelled=job.cancelled.is_set)
        total[0] = run.total_steps
        return Active(job, run, text, lambda: follow(*got) if (got := reader.flush()) is not None else False)

    def _result(self, a: Active, out) -> JobResult:
        """The response's facts, from the run's Generation `out` and the committed text."""
        job, text, run = a.job, a.text, a.run
        P, G = len(job.prompt_ids), out.config.max_new_tokens
        a.tail()
        if not text.done:   # the sampler ended: every position is final, a mask id the model chose included
            delta = text.update(out.tokens[0], final=True)   # decoded as generate() decodes it (mask ids dropped)
            if delta and job.want_steps:
                job.emit("step", StepEvent(out.steps_run, out.steps, 0, delta))
        # a constrained answer that fills the canvas in an accepting state is complete, not cut
        finish = "stop" if (out.stats.get("structured") or {}).get("complete") else text.done
        return JobResult(text.text, finish, P, text.answer_tokens if text.answer_tokens is not None else G, G,
                         out.steps, out.steps_run, out.stopped_early, time.perf_counter() - run.started_at,
                         run.started_at - job.submitted, out.path, out.lossy, out.config.seed,
                         list(text.answer_ids or []), out.stats, text.stop_reason)


def _as_cancelled(err: Exception, a: Active) -> Exception:
    """The engine's RequestCancelled as the server's Cancelled (with the steps that ran)."""
    if isinstance(err, RequestCancelled):
        run = a.run
        return Cancelled(f"request {a.job.id} cancelled after step {run.steps_done} of {run.total_steps}",
                         run.steps_done)
    return err


def _piece(engine):
    tok = engine.model.tokenizer
    if tok is None:
        return lambda ids: " ".join(map(str, ids)) + " "
    return lambda ids: tok.decode(ids, skip_special_tokens=False)
