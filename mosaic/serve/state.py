"""The state behind the server's routes (Server): the engine, its worker and metrics, the served
name, capacity and fingerprint, request admission (parse -> options -> the engine's Request and
Admission, once per request) and shutdown. app.py builds the routes over it."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import re
import secrets
import threading
import time
from collections import deque

from fastapi.concurrency import run_in_threadpool  # noqa: F401  (respond.py runs admit() on the pool)

from .. import __version__
from ..chat_template import DEFAULT_OPTIONS
from ..config import name_defaults
from ..config.structured import spec_of
from ..engine import MosaicEngine
from ..errors import InputError, MemoryBudgetError, MosaicError
from .api_errors import ApiError, api_words, context_overflow, param_of
from .capacity import admit_ceiling, capacity_tokens
from .metrics import Metrics
from .structured import call_schema, constraint_args, history, tool_mode, tool_prompt, unenforced_fields
from .worker import Cancelled, EngineWorker, Job, JobResult

log = logging.getLogger("mosaic.serve")
RETRY_AFTER_MAX_S = 3600


@dataclasses.dataclass
class Admitted:
    prompt_ids: list[int]
    gen: object
    stop: list[str]
    predicted_bytes: int | None
    seconds: float = 0.0   # time admission took (parse to admitted, on the pool thread)
    request: object = None      # the engine's checked Request
    admission: object = None    # its Admission (None: the native path); the worker runs it as admitted
    ignored: dict = dataclasses.field(default_factory=dict)   # field path -> why it changes nothing
    tool_call: bool = False     # the answer is a forced tool call: returned as tool_calls
    stop_ids: tuple[int, ...] = ()   # vLLM's stop_token_ids


class Server:
    """The state behind the routes: engine, worker, metrics, the served name and its capacity,
    the live jobs (cancelled together at shutdown) and the options of `mosaic serve`.
    request_timeout: seconds from arrival after which a request is cancelled (None: never);
    budget_source: where the budget came from (for /health and the log)."""

    def __init__(self, engine: MosaicEngine, name: str | None = None, max_queue: int = 256,
                 api_key: str | None = None, request_timeout: float | None = None,
                 budget_source: str | None = None, max_batch: int = 16, max_model_len: int | None = None):
        self.engine = engine
        self.name = name or engine.model.name
        self.api_key = api_key
        self.request_timeout = request_timeout
        self.budget_source = budget_source or ("--budget / the engine config" if engine.budget.budget_bytes
                                               else "none: nothing limits admission")
        self.worker = EngineWorker(engine, max_queue, on_finish=self._finished, max_batch=max_batch)
        self.metrics = Metrics(engine, lambda: self.worker.length)
        self.created = int(time.time())
        self.cancelled: deque[int] = deque(maxlen=1024)   # steps each cancelled request ran (tests, logs)
        self.capacity_tokens = capacity_tokens(engine)     # what the memory budget admits (None: no budget)
        self.max_model_len = model_len(engine, max_model_len)
        # no request longer than this is admitted, whatever its split (the quick refusal's bound)
        self.ceiling, self.longest = admit_ceiling(engine)
        if self.ceiling is None or self.max_model_len < self.ceiling:
            self.ceiling = self.longest = self.max_model_len
        self.fingerprint = fingerprint(engine)
        self.jobs: dict[int, Job] = {}   # by Job.id
        self.lock = threading.Lock()
        self.closing = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.warned: set[str] = set()
        self.engine_seconds, self.finished_jobs = 0.0, 0   # for Retry-After

    def _finished(self, job: Job, result: JobResult | None, error) -> None:   # the worker thread
        with self.lock:
            self.jobs.pop(job.id, None)
            if result is not None:
                self.engine_seconds += result.engine_seconds
                self.finished_jobs += 1
        if result is not None:
            self.metrics.job_done(result)
        elif isinstance(error, Cancelled):
            self.metrics.cancelled.inc()
            self.cancelled.append(error.steps_run)

    def submit(self, job: Job) -> bool:
        with self.lock:
            if not self.worker.submit(job):
                return False
            self.jobs[job.id] = job
        return True

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the requests ahead times the mean engine time
        of the finished ones (1 s before any finished), within [1, RETRY_AFTER_MAX_S]."""
        with self.lock:
            mean = self.engine_seconds / self.finished_jobs if self.finished_jobs else 1.0
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(mean * self.worker.length)))

    # -- shutdown (SIGINT / SIGTERM, or the app's lifespan ending)
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the routes run on (request_shutdown schedules on it)."""
        self.loop = loop

    def request_shutdown(self) -> None:
        """Thread- and signal-safe: begin_shutdown on the event loop."""
        if self.loop is not None and self.loop.is_running():
            self.loop.call_soon_threadsafe(self.begin_shutdown)
        else:
            self.begin_shutdown()

    def begin_shutdown(self) -> None:
        """New requests get 503; every running or queued job is cancelled (the running one stops
        after its current op: its handler answers 503, its memory is released)."""
        first, self.closing = not self.closing, True
        with self.lock:
            jobs = list(self.jobs.values())
        for job in jobs:
            job.cancel()
        if first:
            log.info("shutting down: %d request(s) cancelled (the running one stops after its current op)",
                     len(jobs))

    def warn_ignored(self, ignored: dict) -> None:
        """Log each ignored field once per name (list indices folded: messages.*.content.*.x)."""
        for path, why in ignored.items():
            key = re.sub(r"\.\d+(?=\.|$)", ".*", path)
            if key not in self.warned:
                self.warned.add(key)
                log.warning("ignoring request field %r: %s (logged once per field name; listed in the "
                            "response's mosaic.ignored)", key, why)

    def model_card(self) -> dict:
        e = self.engine
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "mosaic",
                "family": e.model.cfg.family, "max_model_len": self.max_model_len,
                "trained_length": e.model.cfg.max_seq_len, "capacity_tokens": self.capacity_tokens,
                "device": str(e.model.device), "budget_bytes": e.budget.budget_bytes}

    # -- admission (runs on a thread of the pool: it may record templates)
    def admit(self, req, chat: bool) -> Admitted:
        t0 = time.perf_counter()
        eng = self.engine
        try:
            stop = req.stop_list()
        except ValueError as e:
            raise ApiError(400, str(e), param="stop") from None
        stop_ids = tuple(req.stop_token_ids or ())
        vocab = eng.model.cfg.vocab
        if any(not 0 <= i < vocab for i in stop_ids):
            raise ApiError(400, f"stop_token_ids {[i for i in stop_ids if not 0 <= i < vocab][:8]} are outside the "
                           f"vocabulary [0, {vocab})", param="stop_token_ids")
        canvas, field = req.canvas()
        if canvas is not None and canvas <= 0:
            raise ApiError(400, f"{field} must be positive, got {canvas}", param=field)
        own = eng.sampler.options
        ignored = req.ignored(own, eng.sampler.display)
        where = "messages" if chat else "prompt"
        try:
            cargs, funcs = self.constraint(req, chat, ignored)
            ids = self.prompt_ids(req, chat, canvas, where, funcs)
            gen = eng.generation_config(**req.options(own))
            if req.mask_ratio is not None:
                gen = eng.mask_ratio_config(gen, len(ids), req.mask_ratio, canvas)
            if gen.seed is None:   # a seed for every request, reported, so any answer can be reproduced
                gen = dataclasses.replace(gen, seed=secrets.randbits(63))
            P, G, limit = len(ids), gen.max_new_tokens, eng.config.max_length
            if limit and P + G > limit:
                self.metrics.refusals.labels("max_seq_len").inc()
                raise context_overflow(limit, P, G, "max_seq_len", f"prompt + max_tokens = {P + G} tokens exceeds "
                                       f"max_seq_len {limit}", param=where)
            request = eng.request([ids], config=gen, warn_length=False, **cargs)
            self.refuse_beyond(request, where)
            admission = None if request.native else eng.admit(request.batch, request.length, request.gen,
                                                               constrained=request.grammar is not None)
            predicted = None if admission is None else admission.predicted_bytes
        except MemoryBudgetError as e:
            self.metrics.refusals.labels("memory").inc()
            raise context_overflow(e.max_tokens or 0, P, G, "memory_budget", str(e), param=where,
                                   needed_bytes=e.needed_bytes, available_bytes=e.budget_bytes) from None
        except (InputError, MosaicError) as e:   # a value the caller never set is named as generation_config.json's
            text = name_defaults(str(e), req.options(own), eng.model.generation_defaults)
            raise ApiError(400, api_words(text), param=param_of(e, field)) from None
        return Admitted(ids, gen, stop, predicted, time.perf_counter() - t0, request, admission, ignored,
                        funcs is not None, stop_ids)

    def refuse_beyond(self, request, where: str) -> None:
        """400 context_length_exceeded (reason max_model_len) for a request whose positions (prompt
        + max_tokens; a block-diffusion canvas rounded up to whole blocks) pass max_model_len:
        vLLM's rule, so a model is never run past its trained length unless the operator said so."""
        n = request.positions
        if n <= self.max_model_len:
            return
        self.metrics.refusals.labels("max_model_len").inc()
        trained = self.engine.model.cfg.max_seq_len
        rounded = f" ({n} positions in whole blocks)" if n != request.length else ""
        why = f"the model was trained for {trained} positions; mosaic serve --max-model-len raises the limit" \
            if self.max_model_len == trained else "mosaic serve --max-model-len / --max-seq-len"
        raise context_overflow(self.max_model_len, request.prompt_len, request.gen.max_new_tokens, "max_model_len",
                               f"prompt + max_tokens = {request.length}{rounded} exceeds max_model_len "
                               f"{self.max_model_len} ({why})", param=where)

    @staticmethod
    def constraint(req, chat: bool, ignored: dict) -> tuple[dict, list | None]:
        """(generate()'s constraint keywords, the functions a forced tool call chooses from or
        None); tool_choice 'none' / 'auto' are listed in `ignored` with what they do
        (serve/structured.py). InputError for a malformed or doubled constraint."""
        cargs = constraint_args(req)
        funcs, why = tool_mode(req.tools, req.tool_choice) if chat else (None, None)
        if why:
            ignored["tool_choice"] = why
        if funcs is not None:
            if cargs:
                raise InputError("tool_choice forces a tool call, whose format is the tool's schema: drop "
                                 "response_format / guided_* / structured_outputs", param="tool_choice")
            cargs = {"constraint": spec_of(json_schema=call_schema(funcs), names={"json_schema": "tools"})}
        ignored |= unenforced_fields(req, cargs.get("constraint"), funcs)
        return cargs, funcs

    def prompt_ids(self, req, chat: bool, canvas: int | None, where: str, funcs=None) -> list[int]:
        """The request's prompt as token ids (400 for an empty prompt, one refused by its size
        before tokenizing, or text the tokenizer refuses); funcs: the tools of a forced call, given
        to the chat template or described in a system message (serve/structured.py)."""
        prompt = req.chat() if chat else req.the_prompt()
        tools = None
        tok = self.engine.model.tokenizer
        template = tok.chat_template if tok is not None else None
        if chat:
            try:          # a tool-calling history (tool_calls, tool messages) rendered for the template
                prompt = history(prompt, template)
            except InputError as e:
                raise ApiError(400, str(e), param=e.param) from None
        if funcs is not None:
            prompt = tool_prompt(prompt, funcs, template)
            tools = req.tools if template and "tools" in template else None
        if not chat and len(prompt) == 0:
            raise ApiError(400, "prompt is empty", param="prompt")
        self.refuse_by_size(prompt, canvas, where)
        try:
            options = req.template() if chat else DEFAULT_OPTIONS
            ids = self.engine.encode(prompt, chat=chat, tools=tools, template=options)[0]
        except InputError as e:
            raise ApiError(400, api_words(str(e)), param=param_of(e) or where) from None
        if not ids:
            raise ApiError(400, "prompt is empty (it encodes to no tokens)", param="prompt")
        return ids

    def refuse_by_size(self, prompt, canvas: int | None, where: str) -> None:
        """The quick refusal, before the prompt is tokenized: 400 context_length_exceeded (the
        shape admission's refusal has) when the prompt alone, with a 1-token canvas, is proved
        longer than any request admitted (self.ceiling): token ids by their count; text by its
        bytes over the longest token's (TextTokenizer.least_tokens, a lower bound); chat by its
        longest message (the template adds to it). A request that could fit with a shorter
        canvas is left to admission, whose refusal names the exact figures of its shape.
        canvas: max_tokens as asked (None: 1), reported."""
        ceiling, tok = self.ceiling, self.engine.model.tokenizer
        if ceiling is None:
            return
        G = canvas or 1
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            least, why = len(prompt), f"{len(prompt):,} token ids"
        else:
            texts = [m["content"] for m in prompt] if isinstance(prompt, list) else [prompt]
            texts = [t for t in texts if isinstance(t, str)]
            text = max(texts, key=len, default="")
            if tok is None or 4 * len(text) // tok.max_token_bytes + 1 <= ceiling:   # cannot prove it: encode
                return
            least = tok.least_tokens(text)
            what = "the prompt" if where == "prompt" else "its longest message"
            why = (f"{what} is {len(text.encode('utf-8', 'surrogatepass')):,} bytes, so at least {least:,} tokens "
                   f"(no plain token of this vocabulary covers more than {tok.max_token_bytes} byte(s)); refused "
                   "before tokenizing")
        if least + 1 <= ceiling:
            return
        hard = ceiling == self.max_model_len
        reason = "max_model_len" if hard else "memory_budget"
        self.metrics.refusals.labels("max_model_len" if hard else "memory").inc()   # admission's labels
        bound = f"max_model_len {ceiling}" if hard else \
            f"the memory budget admits no request of more than {self.longest:,} tokens (a 1-token canvas)"
        raise context_overflow(self.longest, least, G, reason, f"{why}; {bound}", param=where)


def model_len(engine: MosaicEngine, asked: int | None) -> int:
    """The longest prompt + max_tokens the server accepts (vLLM's max_model_len): `asked` (mosaic
    serve --max-model-len), else the length the model was trained for (config.json's), at most the
    engine's max_length (--max-seq-len). Above the trained length the answers may degrade (logged
    at start; each such answer says so in mosaic.beyond_trained_length). MosaicError for a value
    above max_length."""
    trained, hard = engine.model.cfg.max_seq_len, engine.config.max_length
    if asked is None:
        return min(trained, hard) if hard else trained
    if hard and asked > hard:
        raise MosaicError(f"--max-model-len {asked} is more than --max-seq-len (max_length) {hard}: give at most "
                          f"{hard}, or raise both")
    if asked > trained:
        log.warning("max_model_len %d is beyond the length %s was trained for (%d): longer answers may degrade",
                    asked, engine.model.name, trained)
    return asked


def fingerprint(engine: MosaicEngine) -> str:
    """system_fingerprint: mosaic-<version>-<8 hex of the model's config and the engine's>: the
    same string for the same backend configuration, another for any change that may change tokens."""
    cfg = {"model": engine.model.name, "model_config": engine.model.cfg.to_dict(),
           "engine": repr(engine.config), "dtype": str(engine.model.dtype), "device": engine.model.device.type}
    digest = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"mosaic-{__version__}-{digest}"
