"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health
and /metrics over one MosaicEngine (FastAPI; run it with server.serve or uvicorn).

A request is checked and admitted before it is queued: parse (400), options and prompt through
the engine (400 with the engine's message), max_seq_len and the memory budget (413 with the
needed and available bytes and the longest prompt + max_tokens that fits). Admitted requests run
one after another on the engine worker (worker.py says why they are not batched). stream: true
sends a server-sent event after every denoising step with the newly committed text."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import time
from collections import deque

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from ..engine import MosaicEngine
from ..errors import InputError, MemoryBudgetError, MosaicError, gib
from .api_errors import HTTP_TYPES, ApiError, api_words, error_of, parse
from .capacity import capacity_tokens
from .metrics import Metrics
from .protocol import ChatRequest, CompletionRequest
from .worker import Cancelled, EngineWorker, Job, JobResult, StepEvent

DISCONNECT_POLL_S = 0.2   # how often a waiting non-streaming request checks its client is still there
@dataclasses.dataclass
class Admitted:
    prompt_ids: list[int]
    gen: object
    stop: list[str]
    predicted_bytes: int | None
    seconds: float = 0.0   # time admission took (parse to admitted, on the pool thread)
    request: object = None      # the engine's checked Request
    admission: object = None    # its Admission (None: the native path); the worker runs it as admitted


class Server:
    """The state behind the routes: engine, worker, metrics, the served name and its capacity."""

    def __init__(self, engine: MosaicEngine, name: str | None = None, max_queue: int = 256):
        self.engine = engine
        self.name = name or engine.model.name
        self.worker = EngineWorker(engine, max_queue, on_finish=self._finished)
        self.metrics = Metrics(engine, lambda: self.worker.length)
        self.created = int(time.time())
        self.cancelled: deque[int] = deque(maxlen=1024)   # steps each cancelled request ran (tests, logs)
        self.capacity_tokens = capacity_tokens(engine)

    def _finished(self, job: Job, result: JobResult | None, error) -> None:
        if result is not None:
            self.metrics.job_done(result)
        elif isinstance(error, Cancelled):
            self.metrics.cancelled.inc()
            self.cancelled.append(error.steps_run)

    # -- admission (runs on a thread of the pool: it may record templates)
    def admit(self, req, chat: bool) -> Admitted:
        t0 = time.perf_counter()
        eng = self.engine
        try:
            stop = req.stop_list()
        except ValueError as e:
            raise ApiError(400, str(e), param="stop") from None
        canvas, field = req.max_tokens, "max_tokens"
        if canvas is None and getattr(req, "max_completion_tokens", None) is not None:
            canvas, field = req.max_completion_tokens, "max_completion_tokens"
        if canvas is not None and canvas <= 0:
            raise ApiError(400, f"{field} must be positive, got {canvas}", param=field)
        try:
            prompt = req.chat() if chat else req.the_prompt()
            if not chat and len(prompt) == 0:
                raise ApiError(400, "prompt is empty", param="prompt")
            ids = eng.encode(prompt, chat=chat)[0]
            if not ids:
                raise ApiError(400, "prompt is empty (it encodes to no tokens)", param="prompt")
            gen = eng.generation_config(**req.options())
            if req.mask_ratio is not None:
                gen = eng.mask_ratio_config(gen, len(ids), req.mask_ratio, req.max_tokens)
            if gen.seed is None:   # a seed for every request, reported, so any answer can be reproduced
                gen = dataclasses.replace(gen, seed=secrets.randbits(63))
            P, total, limit = len(ids), len(ids) + gen.max_new_tokens, eng.config.max_length
            if limit and total > limit:
                self.metrics.refusals.labels("max_seq_len").inc()
                raise ApiError(413, f"prompt ({P} tokens) + max_tokens ({gen.max_new_tokens}) = {total} tokens "
                               f"exceeds max_seq_len {limit}", "request_too_large", "max_seq_len",
                               prompt_tokens=P, requested_tokens=total, max_tokens=limit,
                               max_new_tokens=max(0, limit - P))
            request = eng.request([ids], config=gen)
            admission = None if request.native else eng.admit(request.batch, request.length, request.gen)
            predicted = None if admission is None else admission.predicted_bytes
        except MemoryBudgetError as e:
            self.metrics.refusals.labels("memory").inc()
            raise ApiError(413, str(e), "request_too_large", "memory_budget", prompt_tokens=P,
                           requested_tokens=total, needed_bytes=e.needed_bytes, available_bytes=e.budget_bytes,
                           max_tokens=e.max_tokens, max_new_tokens=max(0, (e.max_tokens or 0) - P)) from None
        except (InputError, MosaicError) as e:
            raise ApiError(400, api_words(str(e))) from None
        return Admitted(ids, gen, stop, predicted, time.perf_counter() - t0, request, admission)


def create_app(engine: MosaicEngine, name: str | None = None, max_queue: int = 256) -> FastAPI:
    """The FastAPI app over `engine` (served as `name`, default the model's name). The app's
    state.server holds the Server (worker, metrics)."""
    server = Server(engine, name, max_queue)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(server.worker.close)

    app = FastAPI(title="Mosaic", summary="OpenAI-compatible server for diffusion LLMs", lifespan=lifespan)
    app.state.server = server

    app.add_middleware(CountRequests, metrics=server.metrics)

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):   # unknown path (404), wrong method (405): OpenAI's shape
        type_, code = HTTP_TYPES.get(exc.status_code, ("invalid_request_error", None))
        message = exc.detail if exc.status_code not in (404, 405) else \
            f"{exc.detail}: {request.method} {request.url.path} (endpoints: docs/SERVING.md)"
        err = ApiError(exc.status_code, str(message), type_, code).response()
        for k, v in (exc.headers or {}).items():   # 405 keeps its Allow header
            err.headers[k] = v
        return err

    @app.exception_handler(Exception)
    async def internal(request, exc: Exception):   # never a traceback to the client
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.name, "queue_length": server.worker.length,
                "device": str(engine.model.device), "budget_bytes": engine.budget.budget_bytes,
                "capacity_tokens": server.capacity_tokens}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": server.name, "object": "model", "created": server.created, "owned_by": "mosaic",
            "family": engine.model.cfg.family, "max_model_len": server.capacity_tokens,
            "device": str(engine.model.device), "budget_bytes": engine.budget.budget_bytes}]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(server, request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(server, request, ChatRequest, chat=True)

    return app


class CountRequests:
    """Counts requests by endpoint and final status (a plain ASGI middleware: it leaves streaming
    and disconnect detection untouched)."""
    ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, sending)
        finally:
            path = scope["path"] if scope["path"] in self.ENDPOINTS else "other"
            self.metrics.requests.labels(path, str(status[0])).inc()


async def handle(server: Server, request: Request, model, chat: bool):
    t0 = time.perf_counter()
    req = await parse(request, model)
    if req.model is not None and req.model != server.name:
        raise ApiError(404, f"model {req.model!r} is not served here; this server serves {server.name!r}",
                       "not_found_error", "model_not_found", "model")
    why = req.unsupported()
    if why:
        raise ApiError(400, why)
    adm = await run_in_threadpool(server.admit, req, chat)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def emit(kind, payload):   # from the worker thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
        except RuntimeError:   # the loop is closed (shutdown): nobody is waiting
            pass
    job = Job(adm.prompt_ids, adm.gen, emit, adm.stop, req.stream_canvas, req.stream, adm.predicted_bytes,
              adm.seconds, request=adm.request, admission=adm.admission)
    if not server.worker.submit(job):
        raise ApiError(503, f"the queue is full ({server.worker.max_queue} requests waiting); retry later",
                       "server_busy", "queue_full")
    kind = "chat.completion" if chat else "text_completion"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{job.id}"
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(sse(server, job, events, rid, kind, chat, usage), media_type="text/event-stream")
    result = await collect(job, events, request)
    if result is None:   # the client went away; nobody reads this
        return Response(status_code=499)
    overhead = max(0.0, time.perf_counter() - t0 - result.queue_seconds - result.engine_seconds)
    server.metrics.overhead.observe(overhead)
    choice = {"index": 0, "finish_reason": result.finish_reason, "logprobs": None}
    choice |= {"message": {"role": "assistant", "content": result.text}} if chat else {"text": result.text}
    mosaic = mosaic_of(result, job, overhead)
    if req.return_token_ids:
        mosaic |= {"prompt_token_ids": adm.prompt_ids, "token_ids": result.token_ids}
    return {"id": rid, "object": kind, "created": int(time.time()), "model": server.name, "choices": [choice],
            "usage": usage_of(result), "mosaic": mosaic}


async def collect(job: Job, events: asyncio.Queue, request: Request) -> JobResult | None:
    """Wait for the job's end, cancelling it if the client disconnects meanwhile (checked every
    DISCONNECT_POLL_S seconds, step events or not)."""
    checked = time.perf_counter()
    while True:
        try:
            kind, payload = await asyncio.wait_for(events.get(), timeout=DISCONNECT_POLL_S)
        except TimeoutError:
            kind, payload = None, None
        if kind == "done":
            return payload
        if kind == "error":
            raise error_of(payload)
        if time.perf_counter() - checked >= DISCONNECT_POLL_S:
            checked = time.perf_counter()
            if await request.is_disconnected():
                job.cancel()
                return None


def usage_of(r: JobResult) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens}


def mosaic_of(r: JobResult, job: Job, overhead: float | None = None) -> dict:
    out = {"canvas_tokens": r.canvas_tokens, "steps": r.steps, "steps_run": r.steps_run,
           "stopped_early": r.stopped_early, "path": r.path, "lossy": r.lossy, "seed": r.seed,
           "engine_seconds": r.engine_seconds, "queue_seconds": r.queue_seconds,
           "admission_seconds": job.admission_seconds, "predicted_bytes": job.predicted_bytes,
           "predicted": gib(job.predicted_bytes) if job.predicted_bytes else None}
    if overhead is not None:
        out["server_seconds"] = overhead
    return out


def _event(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def sse(server: Server, job: Job, events: asyncio.Queue, rid: str, kind: str, chat: bool, usage: bool):
    """Server-sent events: one chunk per denoising step (the new committed text, maybe ""), a
    last chunk with finish_reason, a usage chunk if asked, then [DONE]. A client that goes away
    cancels the job (the generator is closed)."""
    created, obj = int(time.time()), f"{kind}.chunk" if chat else kind
    done = False

    def chunk(delta: str | None, finish=None, extra=None):
        if chat:
            d = {} if delta is None else {"content": delta}
            c = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        else:
            c = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        out = {"id": rid, "object": obj, "created": created, "model": server.name, "choices": [c]}
        if extra is not None:
            out["mosaic"] = extra
        return out
    try:
        if chat:
            first = chunk(None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield _event(first)
        while True:
            what, payload = await events.get()
            if what == "step":
                ev: StepEvent = payload
                extra = {"step": ev.step, "steps": ev.steps, "masked": ev.masked}
                if ev.canvas is not None:
                    extra["canvas"] = ev.canvas
                yield _event(chunk(ev.delta, extra=extra))
            elif what == "done":
                done = True
                r: JobResult = payload
                yield _event(chunk("" if not chat else None, r.finish_reason, mosaic_of(r, job)))
                if usage:
                    yield _event({"id": rid, "object": obj, "created": created, "model": server.name,
                                  "choices": [], "usage": usage_of(r)})
                yield "data: [DONE]\n\n"
                return
            else:
                done = True
                err = error_of(payload)
                yield _event({"error": {"message": err.message, "type": err.type, "code": err.code, **err.extra}})
                yield "data: [DONE]\n\n"
                return
    finally:
        if not done:
            job.cancel()
