"""The fake allocator backend of the budget guard's CPU tests (memory/transient.py): two
simulated caching allocators (the default pool and the transient pool) under one shared limit,
as PyTorch counts every pool against the per-process fraction."""

from __future__ import annotations

from contextlib import contextmanager

from .caching import SMALL_BUFFER, SMALL_SIZE, SimAllocator, SimOOM


class SimBackend:
    """The fake backend: two simulated allocators (default pool, transient pool) under one
    shared limit, as the real allocator counts every pool against the fraction."""

    def __init__(self, strategy: str = "mempool"):
        self.strategy = strategy
        self.default = SimAllocator()
        self.pool: SimAllocator | None = None
        self.limit: int | None = None
        self.in_pool = False

    def _sync_limits(self):
        other = lambda a: (a.reserved if a is not None else 0)  # noqa: E731
        if self.limit is None:
            self.default.limit = None
            if self.pool is not None:
                self.pool.limit = None
            return
        self.default.limit = self.limit - other(self.pool)
        if self.pool is not None:
            self.pool.limit = self.limit - self.default.reserved

    def set_limit(self, nbytes):
        self.limit = nbytes
        self._sync_limits()

    def reserved(self) -> int:
        return self.default.reserved + (self.pool.reserved if self.pool is not None else 0)

    def empty_cache(self):
        self.default.empty_cache()

    def new_pool(self):
        if self.strategy != "mempool":
            return None
        self.pool = SimAllocator()
        self.pool.on_pressure = self._pressure   # the real retry frees the default pool's cache
        self._sync_limits()
        return self.pool

    def _pressure(self):
        self.default.empty_cache()
        self._sync_limits()

    def drop_pool(self, pool):
        if pool is not None and pool is self.pool:
            pool.empty_cache()
            assert pool.reserved == 0, "a transient outlived its step"
            self.pool = None
            self._sync_limits()

    def use(self, pool):
        return self._scope(pool)

    stream = None         # graph mode's stream (none on the simulated device)

    def step_stream(self):
        return _nothing()

    def pool_id(self, pool):
        return pool

    @contextmanager
    def _scope(self, pool):
        self.in_pool = pool is not None
        try:
            yield
        finally:
            self.in_pool = False

    def target(self) -> SimAllocator:
        """Where an allocation made now goes (tests call malloc/free on it)."""
        self._sync_limits()
        return self.pool if self.in_pool and self.pool is not None else self.default

    def malloc(self, nbytes: int) -> tuple:
        a = self.target()
        return a, a.malloc(nbytes)

    def free(self, handle) -> None:
        a, bid = handle
        a.free(bid)
        self._sync_limits()

    def reserve(self, pool, large, small):
        a = pool if pool is not None else self.default
        self._sync_limits()
        if large:
            a.reserve(large)
        blocks = [a.malloc(SMALL_SIZE) for _ in range(2 * (small // SMALL_BUFFER))]
        for b in blocks:
            a.free(b)
        self._sync_limits()

    def is_oom(self, err):
        return isinstance(err, SimOOM)


@contextmanager
def _nothing():
    yield
