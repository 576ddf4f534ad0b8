"""The paged K/V pool: every device-tier block store of an engine in one set of buffers, so one
attention call reads every running sequence's keys (models/batched_attention.py) and sequences
of different lengths share the memory without padding to the longest.

Layout: per layer and kind (K, V) one buffer [rows, kv_dim]; row r holds one token of one
sequence. A store of B sequences of L positions is one extent of whole pages (PAGE_TOKENS rows
each, memory/kv_store.py) holding its sequences one after another: sequence b's position t is row
first_row + b * L + t of every layer's buffers. Extents are contiguous so that the varlen kernels
address a sequence by its first row and length (no page table: PyTorch's flash varlen takes none
before 2.13); fragmentation is handled by compaction instead.

  allocate  first fit among the free pages; when no hole holds the store but the free pages
            would, the extents are compacted first (moved down in order, a copy of their rows),
            so the buffers grow only when the allocated pages need it
  free      a request's pages return when it leaves (store.close())
  charges   a store is charged StoreLayout.device_bytes = its pages x page bytes, exactly what
            allocate takes (tests/memory/test_kv_pool.py)

Storage (the buffers' memory): TensorStorage (memory/kv_storage.py), one tensor [layers, 2,
capacity, kv_dim] from PyTorch's allocator, reallocated when it grows: the old and the new tensor
are alive at once during the copy, and its address moves (`address()` changes and a captured step
keyed by it is captured again: runtime/graphs.py). Without a budget capacity at least doubles
and shrinks never. Under a budget (`exact`) every byte the buffers hold at any instant is one
admission can charge beforehand:

  - growth is to exactly the allocated pages plus the new store's (compacted first, so no hole
    is carried into the new buffers), and `peak_bytes(rows)` says before anything is allocated
    what the buffers hold at the peak of allocating `rows` rows: capacity + the new capacity
    when they grow (the copy), capacity otherwise (compaction moves rows inside the buffers:
    non-overlapping copy_ pieces, no new memory). The Scheduler charges it when a request
    joins (engine/scheduler.py `fits`);
  - the buffers never shrink by a copy (that would hold old + new while nobody is admitted for
    it): freed pages stay as free capacity (charged by the next join's `peak_bytes`, reused
    first fit), and when the last store leaves the buffers are kept, idle (`idle_bytes`), so
    that the next request of the same or a smaller size gets the same rows at the same address
    and replays its captured steps (a new address misses every graph: ~50 ms a capture). Idle
    bytes are held device memory: `held_bytes` and `peak_bytes` count them, a request starting
    keeps them only where its admission leaves room for them (`reuse_or_trim`, from engine/
    run.py), and whoever would refuse work for them gives them back first (`trim`: the
    Scheduler's join). A store too large for idle buffers is made after a trim, not by a copy;
  - the scratch extent never grows the buffers by itself: `scratch_rows` answers None when no
    free pages hold it and the caller runs the step unpadded; the next growth (a join, charged
    by peak_bytes) adds the pages it asked for, so later steps pad to their batch bucket.

The scratch extent (`scratch_row`) holds the rows dummy sequences of a padded batch read and
write (zeros)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_storage import TensorStorage
from .kv_store import PAGE_TOKENS, StoreLayout


@dataclass(eq=False)
class Extent:
    """Pages [page, page + pages) of a pool, owned by one store (moved only by the pool)."""
    page: int
    pages: int


class KVPool:
    """Device-tier block stores of one engine (module docstring). page_tokens: rows per page;
    exact: the buffers hold exactly the allocated pages' span (a memory budget)."""

    def __init__(self, num_layers: int, kv_dim: int, dtype: torch.dtype, device, page_tokens: int = PAGE_TOKENS,
                 exact: bool = False, storage=None):
        self.num_layers, self.kv_dim, self.dtype, self.device = num_layers, kv_dim, dtype, torch.device(device)
        self.page_tokens = page_tokens
        self.storage = storage or TensorStorage(num_layers, kv_dim, dtype, device, exact)
        self.extents: list[Extent] = []            # in page order
        self.scratch: Extent | None = None
        self.scratch_hint = 0           # the most scratch rows a step has asked for (scratch_rows)
        self.compactions = 0

    # -- sizes
    @property
    def page_bytes(self) -> int:
        return 2 * self.num_layers * self.page_tokens * self.kv_dim * self.dtype.itemsize

    @property
    def allocated_pages(self) -> int:
        return sum(e.pages for e in self.extents)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the pages given to stores and the scratch rows."""
        return self.allocated_pages * self.page_bytes

    @property
    def top_page(self) -> int:
        return max((e.page + e.pages for e in self.extents), default=0)

    @property
    def rows(self) -> int:
        """The buffers' rows now (capacity)."""
        return self.storage.capacity

    @property
    def capacity_bytes(self) -> int:
        return self.storage.nbytes

    @property
    def held_bytes(self) -> int:
        """Bytes a step charges for the pool besides its stores' pages: under a budget the whole
        buffers (free and idle capacity stay held: never shrunk by a copy), else 0."""
        return self.capacity_bytes if self.storage.exact else 0

    def pages_for(self, rows: int) -> int:
        return -(-rows // self.page_tokens)

    # -- allocation
    def allocate(self, rows: int) -> Extent:
        """An extent of whole pages holding `rows` rows (module docstring: first fit, compaction,
        growth)."""
        need = self.pages_for(max(1, rows))
        if self.storage.exact and not self._fits(need):
            self.trim()                # idle buffers too small: the new ones alone, no copy (peak_bytes)
        at = self._hole(need)
        if at is None and self._free_below_top() >= need:
            self._compact()
            at = self._hole(need)
        if at is None and self.storage.exact and self._free_below_top():
            self._compact()            # no hole carried into grown buffers: they hold what is charged
        spare = 0
        if at is None:
            at = self.top_page
            spare = self._scratch_spare()
            self.storage.ensure((at + need + spare) * self.page_tokens, self.top_page * self.page_tokens)
        ext = Extent(at, need)
        self.extents.append(ext)
        self.extents.sort(key=lambda e: e.page)
        if spare:                       # the scratch a step asked for, in the pages grown for it
            self.scratch_rows(self.scratch_hint)
        return ext

    def _scratch_spare(self) -> int:
        """Pages a growth under a budget adds for the scratch rows steps have asked for and did
        not get (scratch_rows answers None rather than grow): one copy, charged with the join."""
        want = self.pages_for(self.scratch_hint) if self.scratch_hint else 0
        if not self.storage.exact or (self.scratch is not None and self.scratch.pages >= want):
            return 0
        return want

    def free(self, ext: Extent) -> None:
        """Give an extent's pages back (a request that left); the buffers stay, idle when it was
        the last store (module docstring: never shrunk by a copy; `trim` gives them back)."""
        self.extents = [e for e in self.extents if e is not ext]

    @property
    def live(self) -> bool:
        """Whether a store holds pages (the scratch is no store)."""
        return any(e is not self.scratch for e in self.extents)

    @property
    def idle_bytes(self) -> int:
        """Bytes the buffers hold under a budget while no store is alive (kept for the next
        request: module docstring); 0 while one is, or without a budget."""
        return self.capacity_bytes if self.storage.exact and not self.live else 0

    def trim(self) -> int:
        """Give the buffers back, the scratch with them, when no store is alive (their bytes
        are needed: the next store is a new allocation at a new address); the bytes given back
        (0 while a store is alive: the buffers never shrink by a copy)."""
        freed = 0 if self.live else self.capacity_bytes
        if freed:
            self.close()
        return freed

    def reuse_or_trim(self, rows: int, room: int | None) -> int:
        """At a request's start: keep idle buffers when a store of `rows` rows (0: the request
        keeps none here) fits in them and what they hold beyond it is at most `room` bytes (what
        its admission left of the budget; None: no room known), else `trim` them. Returns the
        bytes the buffers hold beyond the store (0 when none were idle or they were trimmed)."""
        need = self.pages_for(rows) if rows else 0
        beyond = self.idle_bytes - need * self.page_bytes
        if not self.idle_bytes:
            return 0
        if room is None or beyond > room or not self._fits(need):
            self.trim()
            return 0
        return beyond

    def peak_bytes(self, rows: int) -> int:
        """The most bytes the buffers hold while a store of `rows` rows is allocated now (nothing
        is allocated): capacity_bytes when free pages hold it (compaction moves rows in place),
        else capacity_bytes + the grown buffers' bytes (the copy holds both)."""
        need = self.pages_for(max(1, rows))
        if self._fits(need):
            return self.capacity_bytes
        if self.storage.exact and not self.live:      # trimmed first (allocate): the new buffers alone
            spare = self.pages_for(self.scratch_hint) if self.scratch_hint else 0
            return (need + spare) * self.page_bytes
        top = (self.allocated_pages if self.storage.exact else self.top_page) + need + self._scratch_spare()
        return self.capacity_bytes + self.storage.wants(top * self.page_tokens) * self.storage.row_bytes()

    def _fits(self, need: int) -> bool:
        """Whether free pages of the buffers hold `need` pages (a hole, or after compaction)."""
        return self._hole(need) is not None or self._free_below_top() >= need

    def _hole(self, need: int) -> int | None:
        """The first free page run of `need` pages below the capacity, or None."""
        at = 0
        for e in self.extents:
            if e.page - at >= need:
                return at
            at = e.page + e.pages
        return at if self.rows // self.page_tokens - at >= need else None

    def _free_below_top(self) -> int:
        """Free pages within the capacity (holes and the free pages above the top extent)."""
        return self.rows // self.page_tokens - self.allocated_pages

    def _compact(self) -> None:
        """Move every extent down to close the holes (in page order: each one's rows move to
        lower rows only)."""
        at = 0
        for e in self.extents:
            if e.page != at:
                self.storage.move(e.page * self.page_tokens, at * self.page_tokens, e.pages * self.page_tokens)
                e.page = at
            at += e.pages
        self.compactions += 1

    # -- what the step program reads
    def first_row(self, ext: Extent) -> int:
        return ext.page * self.page_tokens

    def layer(self, i: int):
        """(K, V) [rows, kv_dim] of layer i."""
        return self.storage.layer(i)

    def address(self) -> tuple:
        """Changes whenever the buffers move (a captured step's key)."""
        return self.storage.address()

    def scratch_rows(self, n: int) -> int | None:
        """The first of at least n rows (zeros) that dummy sequences of a padded batch use; None
        under a budget when only growing the buffers would give them (run the step unpadded:
        nothing charged that growth; the next growth adds them)."""
        self.scratch_hint = max(self.scratch_hint, n)
        if self.scratch is None or self.scratch.pages * self.page_tokens < n:
            if self.storage.exact and self.peak_bytes(n) > self.capacity_bytes:
                return None
            if self.scratch is not None:
                old, self.scratch = self.scratch, None
                self.extents = [e for e in self.extents if e is not old]
            self.scratch = self.allocate(n)
            self.storage.zero(self.first_row(self.scratch), self.scratch.pages * self.page_tokens)
        return self.first_row(self.scratch)

    def store(self, layout: StoreLayout) -> PooledStore:
        """A device-tier store of `layout` in this pool (its pages allocated now)."""
        return PooledStore(self, layout)

    def close(self) -> None:
        """Forget every extent and give the buffers back (an engine that is closed)."""
        self.extents, self.scratch = [], None
        self.storage.release()


def held_bytes(stores) -> int:
    """Device bytes a step over `stores` (one request's or a stacked step's) charges as resident:
    their pages, or under a budget at least their pool's whole buffers, free capacity included
    (what is really held while the step runs; admission charged it when the last request
    joined: KVPool.peak_bytes)."""
    total = sum(s.layout.device_bytes for s in stores)
    pools = {id(p): p for p in (getattr(s, "pool", None) for s in stores) if p is not None}
    return max(total, sum(p.held_bytes for p in pools.values()))


class PooledStore:
    """A request's block store in a KVPool: the KVStore protocol (begin, acquire, release,
    finish) over its extent; close() gives its pages back."""
    transfer_bytes = 0                    # nothing moves between host and device

    def __init__(self, pool: KVPool, layout: StoreLayout):
        if layout.hot < layout.num_layers:
            raise ValueError(f"a pooled store holds every layer on the device, not {layout.hot} of {layout.num_layers}")
        self.pool, self.layout = pool, layout
        self.extent = pool.allocate(layout.rows)
        self.closed = False
        self.readers: set[str] = set()

    def read_by(self, kernel: str) -> None:
        """Note a batched attention kernel that ran over this store (Generation.lossy names it)."""
        self.readers.add(kernel)

    @property
    def first_row(self) -> int:
        return self.pool.first_row(self.extent)

    def address(self) -> tuple:
        return (self.pool.address(), self.first_row)

    def begin(self, mode: str, lo: int = 0, hi: int = 0) -> None:
        pass

    def acquire(self, layer: int):
        """(K, V) [B, L, kv_dim]: this store's rows of the pool's layer."""
        K, V = self.pool.layer(layer)
        lay, s = self.layout, self.first_row
        n = lay.batch * lay.length
        return K[s:s + n].view(lay.batch, lay.length, -1), V[s:s + n].view(lay.batch, lay.length, -1)

    def release(self, layer: int, wrote: bool) -> None:
        pass

    def finish(self) -> None:
        pass

    def close(self) -> None:
        """Give the pages back (once)."""
        if not self.closed:
            self.closed = True
            self.pool.free(self.extent)
