"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models[/{id}],
/tokenize, /detokenize (tokens.py), /health, /metrics, /version and /ping over one MosaicEngine
(FastAPI; run it with server.serve or uvicorn).

A request is checked and admitted before it is queued: parse (400), options and prompt through
the engine (400 with the engine's message), max_model_len and the memory budget (400
`context_length_exceeded` with the longest prompt + max_tokens that fits). Admitted requests run
on the engine worker (worker.py); responses and streams are built in respond.py. With an API
key the API (/v1/*, /tokenize, /detokenize) needs `Authorization: Bearer KEY` (401 otherwise);
CORS only for the origins given (allowed_origins)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from .. import __version__
from ..engine import MosaicEngine
from ..errors import gib
from .api_errors import HTTP_TYPES, ApiError
from .metrics import Metrics
from .protocol import ChatRequest, CompletionRequest
from .respond import handle
from .state import Server
from .tokens import add_token_routes

log = logging.getLogger("mosaic.serve")
RETRY_AFTER_MAX_S = 3600


def create_app(engine: MosaicEngine, name: str | None = None, max_queue: int = 256, *, api_key: str | None = None,
               request_timeout: float | None = None, budget_source: str | None = None,
               shutdown_timeout: float = 60.0, max_batch: int = 16, max_model_len: int | None = None,
               allowed_origins: tuple[str, ...] = (), protect_metrics: bool = False) -> FastAPI:
    """The FastAPI app over `engine` (served as `name`, default the model's name). The app's
    state.server holds the Server (worker, metrics). shutdown_timeout: seconds the lifespan's end
    waits for the engine thread (a step in flight) after cancelling its work. max_batch: the most
    sequences the worker's continuous batch holds (1: one request at a time). max_model_len: the
    longest prompt + max_tokens accepted (default the model's trained length: state.model_len).
    allowed_origins: browser origins CORS lets call the API ("*": any; none by default).
    protect_metrics: /metrics needs the API key too (by default, as in vLLM, only the API needs it)."""
    server = Server(engine, name, max_queue, api_key, request_timeout, budget_source, max_batch, max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.attach(asyncio.get_running_loop())
        yield
        server.begin_shutdown()
        await run_in_threadpool(server.worker.close, shutdown_timeout)

    app = FastAPI(title="Mosaic", summary="OpenAI-compatible server for diffusion LLMs", lifespan=lifespan)
    app.state.server = server
    if api_key:
        app.add_middleware(RequireKey, key=api_key, protect_metrics=protect_metrics)
    app.add_middleware(CountRequests, metrics=server.metrics)   # counts the 401s too
    if allowed_origins:    # outermost: a browser's preflight is answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    _error_handlers(app)
    _info_routes(app, server)
    _generation_routes(app, server)
    add_token_routes(app, server)
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape; never a traceback to the client."""
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
    async def internal(request, exc: Exception):
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()


def _info_routes(app: FastAPI, server: Server) -> None:
    """/health, /v1/models[/{id}], /metrics, /version and /ping (vLLM's liveness probe)."""
    engine = server.engine

    @app.get("/health")
    async def health():
        budget = engine.budget.budget_bytes
        return {"status": "shutting_down" if server.closing else "ok", "model": server.name,
                "queue_length": server.worker.length, "device": str(engine.model.device), "budget_bytes": budget,
                "budget": gib(budget) if budget else None, "budget_source": server.budget_source,
                "capacity_tokens": server.capacity_tokens, "max_model_len": server.max_model_len,
                "trained_length": engine.model.cfg.max_seq_len,
                "auth": bool(server.api_key), "system_fingerprint": server.fingerprint}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != server.name:
            raise ApiError(404, f"The model {model_id!r} does not exist; this server serves {server.name!r}",
                           "invalid_request_error", "model_not_found", "model")
        return server.model_card()

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return Response(status_code=200)


def _generation_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(server, request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(server, request, ChatRequest, chat=True)


class RequireKey:
    """`Authorization: Bearer KEY` on the routes that do work (as vLLM: the /v1 API, and here
    /tokenize and /detokenize; /metrics too with protect_metrics), a plain ASGI middleware, the
    key compared in constant time; 401 in OpenAI's error shape otherwise. /health, /ping,
    /version and (by default) /metrics stay open: probes and scrapers carry no key."""
    PROTECTED = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app, key: str, protect_metrics: bool = False):
        self.app, self.key = app, key.encode()
        self.protected = self.PROTECTED + (("/metrics",) if protect_metrics else ())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(self.protected):
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                given = token.strip() if scheme.lower() == b"bearer" else b""
        if hmac.compare_digest(given, self.key):
            return await self.app(scope, receive, send)
        why = "no API key given" if not given else "the API key is wrong"
        err = ApiError(401, f"{why}: this server needs 'Authorization: Bearer <key>' (the key of mosaic serve "
                       "--api-key / MOSAIC_API_KEY)", "invalid_request_error", "invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
        await err.response()(scope, receive, send)


class CountRequests:
    """Counts requests by endpoint and final status (a plain ASGI middleware: it leaves streaming
    and disconnect detection untouched)."""
    ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
                 "/detokenize", "/version", "/ping")

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
