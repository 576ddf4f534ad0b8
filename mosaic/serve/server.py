"""Running the app: serve() in the foreground (mosaic serve), ServerThread in the background
(tests and benchmarks: an in-process uvicorn on 127.0.0.1 that stops when asked).

SIGINT / SIGTERM: uvicorn stops accepting connections; here every running or queued request is
cancelled at once (uvicorn alone would wait for in-flight requests, a stream for its whole
length), the engine thread is joined once its step stopped (after its current op), and the process exits 0. uvicorn
raises the signal again after a graceful shutdown (a SIGTERM would then kill the process, exit
143); this server does not. The engine thread must not be inside torch when the interpreter
finalises (that aborted with `terminate called without an active exception`, exit 134): if a
step outlasts --shutdown-timeout, the process leaves with os._exit after logging it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

from ..engine import MosaicEngine
from .app import create_app

log = logging.getLogger("mosaic.serve")


class Uvicorn(uvicorn.Server):
    """uvicorn's server that cancels the app's work on the first signal and exits 0."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self.on_exit = on_exit
        self.exit_at: float | None = None       # perf_counter() of the first signal

    def handle_exit(self, sig, frame) -> None:
        if self.exit_at is None:
            self.exit_at = time.perf_counter()
        super().handle_exit(sig, frame)
        self.on_exit()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():   # signals only reach the main thread
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def serve(engine: MosaicEngine, host: str = "127.0.0.1", port: int = 8000, name: str | None = None,
          max_queue: int = 256, log_level: str = "info", *, api_key: str | None = None,
          request_timeout: float | None = None, shutdown_timeout: float = 60.0,
          budget_source: str | None = None, max_batch: int = 16, max_model_len: int | None = None,
          allowed_origins: tuple[str, ...] = (), protect_metrics: bool = False) -> None:
    """Serve until SIGINT / SIGTERM, then cancel the work and return (exit code 0)."""
    _log_to_stderr(log_level)
    app = create_app(engine, name, max_queue, api_key=api_key, request_timeout=request_timeout,
                     budget_source=budget_source, shutdown_timeout=shutdown_timeout, max_batch=max_batch,
                     max_model_len=max_model_len, allowed_origins=allowed_origins, protect_metrics=protect_metrics)
    state = app.state.server
    budget = engine.budget.budget_bytes
    cap = state.capacity_tokens
    log.info("serving %s on %s: budget %s (%s); capacity %s tokens (prompt + max_tokens); max_model_len %s "
             "(trained for %s); queue %d; batch up to %d sequences; %s%s",
             state.name, engine.model.device, f"{budget / 2**30:.2f} GiB" if budget else "none", state.budget_source,
             f"{cap:,}" if cap else "unbounded", f"{state.max_model_len:,}", f"{engine.model.cfg.max_seq_len:,}",
             max_queue, max_batch,
             "API key required" if api_key else "no API key (--api-key or MOSAIC_API_KEY to require one)",
             f"; request timeout {request_timeout:g} s" if request_timeout else "")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=max(1, int(shutdown_timeout)))
    server = Uvicorn(config, state.request_shutdown)
    server.run()
    if state.worker.thread.is_alive():
        waited = 0.0 if server.exit_at is None else time.perf_counter() - server.exit_at
        log.warning("the engine thread is still in a step %.1f s after the shutdown began (--shutdown-timeout %g s, "
                    "or a second signal); leaving without waiting for it", waited, shutdown_timeout)
        logging.shutdown()
        os._exit(0)
    log.info("stopped")


def _log_to_stderr(level: str) -> None:
    """mosaic.serve's records on stderr in uvicorn's format (its loggers are configured apart)."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
    log.setLevel(level.upper())


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn on a background thread: `with ServerThread(engine) as srv: srv.url`. Stops (and
    joins) on exit; start() waits at most `timeout` seconds for the socket. Keyword options go
    to create_app (api_key, request_timeout, ...)."""

    def __init__(self, engine: MosaicEngine, host: str = "127.0.0.1", port: int | None = None,
                 name: str | None = None, max_queue: int = 256, timeout: float = 60.0, **options):
        self.app = create_app(engine, name, max_queue, **options)
        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=self.host, port=self.port,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="mosaic-uvicorn", daemon=True)
        self.timeout = timeout

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerThread:
        self.thread.start()
        t0 = time.perf_counter()
        while not self.server.started:
            if not self.thread.is_alive() or time.perf_counter() - t0 > self.timeout:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.app.state.server.request_shutdown()
        self.server.should_exit = True
        self.thread.join(self.timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
