"""A fake graph backend for the CPU tests of runtime/graphs.py: capture(fn) keeps fn as the
'graph' and returns its outputs; replay re-runs it (it reads the static inputs). Its generator
is a CPU one, loaded with the request's stream by copying its state; `advance` replays on the
request's generator what the eager step would have drawn for its real rows (the CPU generator
fills in order, so this is exactly the eager consumption). Optional: the bytes a graph's
'executable' takes (driver_bytes, counted on `device` if given) and the transient bytes a
capture allocates in the pool it is given (through `device.backend`)."""

import torch

DRAW = {"uniform": lambda t, g: t.uniform_(generator=g),
        "exponential": lambda t, g: t.exponential_(1, generator=g)}


class FakeGraphs:
    def __init__(self, fail: bool = False, driver_bytes: int = 0, device=None, transient_bytes: int = 0):
        self.fail, self.captured, self.replayed = fail, 0, 0
        self.generator = torch.Generator()
        self.draw_problem = None
        self.driver_bytes, self.device, self.transient_bytes = driver_bytes, device, transient_bytes
        self.held = 0            # bytes the 'executables' hold now (what the device counts)
        self.pools = []

    def capture(self, fn, pool=None, draws=False):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captured += 1
        self.pools.append(pool)
        if self.device is not None and self.transient_bytes:   # the capture's transients, from the pool
            with self.device.backend.use(pool[0] if pool is not None else None):
                self.device.backend.free(self.device.backend.malloc(self.transient_bytes))
        return _Graph(self, fn), fn()

    def replay(self, graph):
        self.replayed += 1
        graph.fn()

    def measure(self):
        """(the driver's counter, PyTorch's reserved): the simulated device's, else the held bytes."""
        if self.device is None:
            return self.held, 0
        return self.device.used(), self.device.backend.reserved()

    def load(self, generator):
        src = generator if generator is not None else torch.default_generator
        state = src.get_state()
        self.generator.set_state(state)
        return src, state

    def advance(self, token, real, padded):
        src, state = token
        src.set_state(state)
        for kind, n, dtype in real:
            DRAW[kind](torch.empty(n, dtype=dtype), src)

    def restore(self, token):
        src, state = token
        src.set_state(state)


class _Graph:
    """A fake graph: its executable's bytes are held while it lives."""

    def __init__(self, backend, fn):
        self.backend, self.fn = backend, fn
        self.bytes = backend.driver_bytes
        backend.held += self.bytes
        if backend.device is not None:
            backend.device.outside += self.bytes
            backend.device.sample()

    def __del__(self):
        self.backend.held -= self.bytes
        if self.backend.device is not None:
            self.backend.device.outside -= self.bytes


class CapturingGraphs(FakeGraphs):
    """FakeGraphs whose captures and replays run the step as a CUDA capture does: with
    published.capturing() true (monkeypatch it to `capturing`), so a reducer takes its captured
    path (no host reads; the "ok" flag, and the redo where it is False) instead of the eager one."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.inside = False

    def capturing(self) -> bool:
        return self.inside

    def capture(self, fn, pool=None, draws=False):
        self.inside = True
        try:
            return super().capture(fn, pool, draws)
        finally:
            self.inside = False

    def replay(self, graph):
        self.inside = True
        try:
            super().replay(graph)
        finally:
            self.inside = False
