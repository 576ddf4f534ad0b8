"""One engine worker thread and its queue: requests that were admitted run one after another.

Each job carries the engine's Request and the Admission the server made before queueing it, so
a request is admitted once; the worker runs it as a RequestRun and reads its Generation (early
stop is a return value of on_step, not an exception).

Requests are not batched: a batch of B canvases runs GEMMs of B*L rows instead of L, which may
pick other kernels and reduction orders (so bf16 logits, and near-tie argmaxes, can differ), and
the samplers draw one random stream for the whole batch (temperature > 0). Either way a request
would not get exactly the tokens it gets alone, so each runs singly.

A job talks to its HTTP handler through `events` (put from this thread with the event loop's
call_soon_threadsafe): ("step", StepEvent) after every denoising step, then one ("done", JobResult)
or ("error", MosaicError/Exception). Cancelling a job (client gone) makes its next on_step raise
Cancelled, which stops the engine between two steps: nothing is in flight then, the arena stays
mapped for the next request, and the canvas is dropped."""

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
from ..engine import MosaicEngine
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


class EngineWorker:
    """Runs jobs on one thread. on_finish(job, result|None, error|None) reports each job
    (metrics). max_queue: jobs waiting beyond the running one before submit() refuses."""

    def __init__(self, engine: MosaicEngine, max_queue: int = 256, on_finish=None):
        self.engine = engine
        self.max_queue = max_queue
        self.on_finish = on_finish or (lambda job, result, error: None)
        self.queue: queue.Queue = queue.Queue()
        self.running: Job | None = None
        self.thread = threading.Thread(target=self._loop, name="mosaic-engine", daemon=True)
        self.thread.start()

    @property
    def length(self) -> int:
        """Jobs waiting plus the one running."""
        return self.queue.qsize() + (self.running is not None)

    def submit(self, job: Job) -> bool:
        """Queue an admitted job; False when the queue is full."""
        if self.queue.qsize() >= self.max_queue:
            return False
        self.queue.put(job)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Cancel what runs, drain the queue and stop the thread."""
        if self.running is not None:
            self.running.cancel()
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit("error", Cancelled("the server is shutting down"))
        self.queue.put(None)
        self.thread.join(timeout)

    def _loop(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            if job.cancelled.is_set():
                self._finish(job, None, Cancelled("the client went away before the request started"))
                continue
            self.running = job
            try:
                result = self.run(job)
                self._finish(job, result, None)
            except Exception as e:  # every failure is reported to its request, the loop goes on
                if not isinstance(e, Cancelled):
                    log.exception("request %s failed", job.id)
                self._finish(job, None, e)
            finally:
                self.running = None

    def _finish(self, job, result, error) -> None:
        try:
            self.on_finish(job, result, error)
        finally:
            job.emit("error" if error is not None else "done", error if error is not None else result)

    def run(self, job: Job) -> JobResult:
        """Generate for one job on this thread, streaming committed text through job.emit."""
        engine, gen = self.engine, job.gen
        cfg = engine.model.cfg
        P, G = len(job.prompt_ids), gen.max_new_tokens
        steps = engine.sampler.total_steps(gen)
        text = CommittedText(engine.decode, eos_ids(cfg), cfg.mask_id, list(job.stop))
        ran = [0]

        def on_step(i: int, canvas: torch.Tensor) -> None:
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

        job.mark_started()
        request = job.request if job.request is not None else engine.request([job.prompt_ids], config=gen)
        out = engine.start(request, admission=job.admission, on_step=on_step, progress=False).run()
        early = out.stopped_early
        seconds = time.perf_counter() - job.started
        if not text.done:   # every step ran: the canvas is complete
            raise RuntimeError(f"request {job.id}: the sampler ended with masked positions left")
        return JobResult(text.text, text.done, P, text.answer_tokens if text.answer_tokens is not None else G, G,
                         steps, ran[0], early, seconds, job.started - job.submitted, out.path, out.lossy, gen.seed,
                         list(text.answer_ids or []), out.stats)


def _piece(engine):
    tok = engine.model.tokenizer
    if tok is None:
        return lambda ids: " ".join(map(str, ids)) + " "
    return lambda ids: tok.decode(ids, skip_special_tokens=False)
