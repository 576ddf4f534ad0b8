"""The transient pool and the budget's backstop: nothing a step allocates outside its plan comes
from an unbounded place.

Under a budget on a GPU, three kinds of device memory exist besides the arena's pages (which
Mosaic maps itself, outside PyTorch): what the driver holds (CUDA context, library handles,
loaded kernels; measured at engine start), PyTorch's caching allocator for the weights and the
request's per-token tensors, and the step's out-of-plan transients (SDPA's output and
log-sum-exp, regrouped q, MoE routing lists, the fused kernel's combine temporaries). Before each
step `DeviceGuard.before_step`:

  1. sizes the transient pool to the step's charge, `caching.pool_bytes(external peak)` plus two
     small-pool segments, as one segment of a dedicated `torch.cuda.MemPool` (allocated and
     freed once: the allocator keeps it cached for the pool); the step's ops run inside
     `scope()`, so every transient is carved from that segment, and neither transients nor the
     request's tensors can land in, or pin, the other's segments;
  2. sets PyTorch's per-process memory fraction to what the budget leaves PyTorch:
     budget - driver-held bytes - the arena's pages. The allocator can then never hold more; it
     frees cached segments by itself before it would, and only raises out-of-memory where live
     tensors need more, which admission's charges rule out (docs/MEMORY.md).
The order is what makes the sum hold at every instant (the second GPU soak: 12 requests over,
up to 3.69 GB, each a large pool reserved while the previous plan's pages were still mapped):
the arena is first cut down to the new plan (pages above it unmapped), then PyTorch is capped
for the pages that remain, then the pool is reserved, and only then does the arena grow.
`begin` does the same at a request's start, before the request's own tensors exist, and also
hands back every cached block of earlier requests (the cap was lifted between requests).

Without torch.cuda.MemPool (torch < 2.5) the pool is a segment reserved in the default pool and
handed back when the step's ops end ('shared'), so request tensors never settle in it; the
engine's transient_pool ('auto' | 'mempool' | 'shared') forces either one.

Captured steps (graph mode, `use_graphs`): the pool is also the graphs' memory pool. A capture
runs the same ops as the eager step and allocates the same transients, each freed before the
next op starts, so it is carved from the one reserved segment as the eager step is; a replay
allocates nothing (its transients sit at the addresses the capture took in the segment). Three
things change. The pool is kept across steps and requests (the graphs' addresses are in it):
a step keeps it when it holds the step's charge and exceeds it by no more than the step leaves
unused of what admission allowed (`slack`), else the graphs are dropped first (`on_drop`) and
the pool is rebuilt. Every planned step runs on one stream, the backend's `stream`, eager or
replayed, since the allocator serves a stream only from segments made on it. And what graphs
hold outside PyTorch (their executables) is charged like the driver's own bytes, `graph_bytes`,
under the cap, so the order above still holds: arena cut, cap for budget - outside -
graph_bytes - pages, pool reserved (or kept), arena grown, and the graphs' executables held
under graph_bytes by runtime/graphs.py before they are made. When nothing changed since the
last step (same pool, same pages, same cap), nothing is done: the cap in force already bounds
PyTorch.

The policy talks to a small backend (set_limit, reserved, empty_cache, new_pool, reserve); the
CPU tests drive it with a simulated caching allocator (caching.SimAllocator)."""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

from ..errors import InputError, MemoryBudgetError, gib
from .caching import SMALL_BUFFER, SMALL_SIZE, pool_bytes
from .sim_backend import SimBackend  # noqa: F401  (the fake backend of the CPU tests, imported from here)

# two small-pool segments for the small transients of an op (rmsnorm and RoPE row statistics,
# flash's RNG state, MoE expert counts: a few hundred KiB at ROW_TILE = 4096 rows)
SMALL_POOL_BYTES = 2 * SMALL_BUFFER


def fraction_for(nbytes: int, *totals: int) -> float:
    """The per-process fraction that caps PyTorch at `nbytes`. PyTorch multiplies it by the
    device's total: cudaMemGetInfo's total up to torch 2.4, cudaDeviceProp.totalGlobalMem from
    2.5 (c10/cuda/CUDACachingAllocator.cpp, setMemoryFraction; a new segment is refused when
    reserved + segment > fraction x total, every pool counted). Taken against the largest total
    and rounded down, so that fraction x total <= nbytes for each of them."""
    top = max(totals)
    frac = max(0.0, min(1.0, nbytes / top))
    while frac > 0 and any(int(frac * t) > nbytes for t in totals):
        frac = math.nextafter(frac, 0.0)
    return frac


def arena_trim(arena, plan_bytes: int) -> int:
    """Unmap the arena's pages above `plan_bytes` now (waiting for the GPU first) and return the
    bytes it still holds outside PyTorch's allocator (a host arena is inside it: 0)."""
    if arena is None:
        return 0
    if hasattr(arena, "trim"):    # an arena that cannot trim: what it holds is charged as is
        arena.trim(plan_bytes)
    return getattr(arena, "physical_bytes", arena.mapped_bytes) if arena.kind == "vmm" else 0


class TorchCudaBackend:
    """PyTorch's CUDA caching allocator on one device. strategy (the engine's transient_pool):
    'mempool' (a private torch.cuda.MemPool for transients), 'shared' (a reserved segment in the
    default pool; for measurement, or around a torch MemPool bug) or 'auto' (mempool where torch
    has it: 2.5 and later); stream: graph mode's stream (runtime/graph_backend.py; None: the
    caller's). Raises InputError for another strategy, or 'mempool' on a torch without MemPool."""

    def __init__(self, device, strategy: str = "auto", stream=None):
        import torch
        self.torch, self.device = torch, torch.device(device)
        has_pool = hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")
        self.strategy = ("mempool" if has_pool else "shared") if strategy == "auto" else strategy
        if self.strategy not in ("mempool", "shared"):
            raise InputError(f"transient_pool={strategy!r}: use 'auto', 'mempool' or 'shared'")
        if self.strategy == "mempool" and not has_pool:
            raise InputError(f"transient_pool='mempool' needs torch.cuda.MemPool (torch >= 2.5; here "
                             f"{torch.__version__}): use 'auto' or 'shared'")
        self._totals = (int(torch.cuda.mem_get_info(self.device)[1]),
                        int(torch.cuda.get_device_properties(self.device).total_memory))
        self.stream = stream      # graph mode: the stream every planned step runs on (the graphs')

    def set_limit(self, nbytes: int | None) -> None:
        frac = 1.0 if nbytes is None else fraction_for(nbytes, *self._totals)
        self.torch.cuda.set_per_process_memory_fraction(frac, self.device)

    def reserved(self) -> int:
        return int(self.torch.cuda.memory_reserved(self.device))

    def empty_cache(self) -> None:
        self.torch.cuda.empty_cache()

    def new_pool(self):
        return self.torch.cuda.MemPool() if self.strategy == "mempool" else None

    def use(self, pool):
        return self.torch.cuda.use_mem_pool(pool, self.device) if pool is not None else nullcontext()

    def pool_id(self, pool):
        return pool.id

    @contextmanager
    def step_stream(self):
        """Run on self.stream, after what the caller's stream queued; the caller's stream then
        waits for it (tensors made before are read there, outputs are copied after)."""
        cuda = self.torch.cuda
        if self.stream is None:
            yield
            return
        caller = cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with cuda.stream(self.stream):
            yield
        caller.wait_stream(self.stream)

    def reserve(self, pool, large: int, small: int) -> None:
        """Allocate then free `large` bytes as one block and `small` bytes of small-pool
        segments (1 MiB blocks, two to a 2 MiB segment) in `pool`."""
        t = self.torch
        with self.use(pool):
            keep = [t.empty(large, dtype=t.uint8, device=self.device)] if large else []
            n_small = 2 * (small // SMALL_BUFFER)
            keep += [t.empty(SMALL_SIZE, dtype=t.uint8, device=self.device) for _ in range(n_small)]
            del keep

    def is_oom(self, err: Exception) -> bool:
        return isinstance(err, self.torch.cuda.OutOfMemoryError)


@dataclass
class DeviceGuard:
    """Per-step memory discipline under a budget (see the module docstring).

    budget_bytes: the budget; outside_bytes: what the driver holds outside PyTorch and the
    arena (context + the driver's share of the measured workspace + the late-load allowance)."""
    backend: object
    budget_bytes: int
    outside_bytes: int
    pool_size: int = -1             # (large, small) bytes the current pool was reserved at
    _pool: object = None
    steps: int = 0
    limit_bytes: int | None = None        # the cap in force now (None: lifted)
    last_limit_bytes: int | None = None   # the last cap set (kept after the request, for reports)
    keep: bool = False              # graph mode: the pool is the graphs' too (module docstring)
    graph_bytes: int = 0            # charged for the graphs' executables, outside PyTorch
    on_drop: object = None          # called before a kept pool goes: the graphs replaying from it

    def add_outside(self, nbytes: int) -> None:
        """Charge (or, negative, release) bytes held outside PyTorch and the arena."""
        self.outside_bytes += nbytes

    def host_graphs(self, on_drop) -> None:
        """Graphs replay from the pool in graph mode: on_drop() drops them before it goes."""
        self.on_drop = on_drop

    def use_graphs(self, keep: bool, graph_bytes: int = 0) -> None:
        """Graph mode on (keep: the pool persists, on the backend's stream, and graphs' executables
        of up to graph_bytes are charged outside PyTorch) or off. A change of mode drops the pool."""
        if keep != self.keep:
            self._drop()
        self.keep, self.graph_bytes = keep, graph_bytes if keep else 0

    def torch_limit(self, arena_bytes: int) -> int:
        """What the budget leaves PyTorch's allocator while `arena_bytes` of pages are mapped."""
        return self.budget_bytes - self.outside_bytes - self.graph_bytes - arena_bytes

    def before_step(self, transient_bytes: int, arena_bytes: int, arena=None, plan_bytes: int | None = None,
                    slack: int = 0) -> None:
        """Size the pool for a step that allocates at most `transient_bytes` outside its plan
        and will map `arena_bytes` (pages outside PyTorch); then cap PyTorch at what is left of
        the budget. arena: the step's arena, cut down to `plan_bytes` (default arena_bytes)
        first, so that no page of an earlier, larger plan is mapped while PyTorch fills the cap;
        pages it could not release are charged against the cap. slack: in graph mode, how much
        larger than this step's charge a kept pool may be (what the step leaves unused of what
        admission allowed: engine/device_memory.py).

        Raises MemoryBudgetError if live tensors already exceed the cap (an accounting bug:
        admission charged less than is held) or the pool cannot be reserved under it."""
        self._prepare(transient_bytes, arena_bytes, arena, plan_bytes, fresh=False, slack=slack)
        self.steps += 1

    def begin(self, transient_bytes: int, arena_bytes: int, arena=None, plan_bytes: int | None = None,
              slack: int = 0) -> None:
        """At a request's start, after admission and before any of its tensors exist: the same
        as before_step for its first step, and every cached block of earlier requests handed
        back, so that the request's tensors are made under the cap next to nothing but what the
        budget charges. On MemoryBudgetError (live tensors the budget does not cover, e.g. the
        caller's own) the cap is lifted again and nothing is taken."""
        try:
            self._prepare(transient_bytes, arena_bytes, arena, plan_bytes, fresh=True, slack=slack)
        except MemoryBudgetError:
            self.end()
            raise

    def _size(self, transient_bytes: int, slack: int) -> int:
        """The pool to hold for a step: its charge (graph mode: at least the small segments, the
        graphs' pool must exist), or in graph mode the kept pool where it may stay."""
        size = pool_bytes(transient_bytes) + SMALL_POOL_BYTES if transient_bytes > 0 else 0
        if not self.keep:
            return size
        size = max(size, SMALL_POOL_BYTES)
        return self.pool_size if size <= self.pool_size <= size + slack else size

    def _prepare(self, transient_bytes, arena_bytes, arena, plan_bytes, fresh: bool, slack: int = 0) -> None:
        size = self._size(transient_bytes, slack)
        if size != self.pool_size:
            self._drop()
        pages = arena_bytes
        if arena is not None:     # unmap above the new plan before anything else can grow
            pages = max(arena_bytes, arena_trim(arena, arena_bytes if plan_bytes is None else plan_bytes))
        limit = self.torch_limit(pages)
        if not fresh and limit == self.limit_bytes and size == self.pool_size:
            return                # nothing changed: the cap in force bounds PyTorch already
        self.limit_bytes = self.last_limit_bytes = limit
        self.backend.set_limit(limit)
        if fresh or self.backend.reserved() > limit:
            self.backend.empty_cache()      # cached blocks of earlier steps, free but reserved
        held = self.backend.reserved()
        if held > limit:
            raise MemoryBudgetError(
                f"PyTorch holds {gib(held)} of live tensors but the budget leaves it {gib(limit)} "
                f"next to {gib(pages)} of planned workspace: Mosaic's accounting missed "
                f"{gib(held - limit)} (please report), or tensors the budget does not cover are "
                f"alive (free them before the request)", needed_bytes=held, budget_bytes=limit)
        if size and self.pool_size != size:
            self._pool = self.backend.new_pool()
            try:
                with self.stream():
                    self.backend.reserve(self._pool, size - SMALL_POOL_BYTES, SMALL_POOL_BYTES)
            except Exception as e:
                if not self.backend.is_oom(e):
                    raise
                raise MemoryBudgetError(
                    f"the step's out-of-plan pool of {gib(size)} does not fit next to "
                    f"{gib(self.backend.reserved())} held by PyTorch under its {gib(limit)} share of "
                    f"the budget: Mosaic's accounting missed it (please report)",
                    needed_bytes=size, budget_bytes=limit) from None
            self.pool_size = size
        elif not size:
            self.pool_size = 0      # no pool needed (and none held): the next such step changes nothing

    def release(self, arena=None) -> None:
        """Hand everything outside the weights back now: the pool, the arena's pages, PyTorch's
        cached blocks (between requests; the next request maps and reserves again)."""
        self._drop()
        arena_trim(arena, 0)
        self.backend.empty_cache()

    def stream(self):
        """The context a planned step runs in, eager or replayed: graph mode's stream."""
        return self.backend.step_stream() if self.keep else nullcontext()

    def graph_pool(self):
        """(pool id, stream) a capture must allocate from (graph mode, the pool reserved), else None."""
        if not self.keep or self._pool is None:
            return None
        return self.backend.pool_id(self._pool), self.backend.stream

    @contextmanager
    def scope(self):
        """The step's ops run inside: their allocations come from the transient pool."""
        if self.pool_size <= 0:
            yield
            return
        with self.backend.use(self._pool):
            yield
        if self._pool is None:   # 'shared': hand the segment back before request tensors land
            self.backend.empty_cache()
            self.pool_size = -1

    def drop_pool(self) -> None:
        """Drop the pool now (a capture into it failed: runtime/graphs.py); the next step
        reserves a new one."""
        self._drop()

    def _drop(self) -> None:
        if self._pool is not None and self.keep and self.on_drop is not None:
            self.on_drop()          # the graphs replaying from the pool go first
        if self._pool is not None:
            pool, self._pool = self._pool, None
            if hasattr(self.backend, "drop_pool"):
                self.backend.drop_pool(pool)
            del pool
            self.backend.empty_cache()
        self.pool_size = -1

    def end(self) -> None:
        """After a request: lift the cap (the budget binds Mosaic's requests, not the caller's
        own tensors between them) and keep the pool for the next request of the same size."""
        self.backend.set_limit(None)
        self.limit_bytes = None

    def close(self) -> None:
        self._drop()
        self.end()
