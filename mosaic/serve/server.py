"""Running the app: serve() in the foreground (mosaic serve), ServerThread in the background
(tests and benchmarks: an in-process uvicorn on 127.0.0.1 that stops when asked)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from ..engine import MosaicEngine
from .app import create_app


def serve(engine: MosaicEngine, host: str = "127.0.0.1", port: int = 8000, name: str | None = None,
          max_queue: int = 256, log_level: str = "info") -> None:
    """Serve until interrupted (Ctrl-C)."""
    uvicorn.run(create_app(engine, name, max_queue), host=host, port=port, log_level=log_level)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn on a background thread: `with ServerThread(engine) as srv: srv.url`. Stops (and
    joins) on exit; start() waits at most `timeout` seconds for the socket."""

    def __init__(self, engine: MosaicEngine, host: str = "127.0.0.1", port: int | None = None,
                 name: str | None = None, max_queue: int = 256, timeout: float = 60.0):
        self.app = create_app(engine, name, max_queue)
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
        self.server.should_exit = True
        self.thread.join(self.timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
