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
  free      a request's pages return when it leaves (store.close()); the top of the buffers
            shrinks to the highest allocated page under a budget (`exact`)
  charges   a store is charged StoreLayout.device_bytes = its pages x page bytes, exactly what
            allocate takes (tests/memory/test_kv_pool.py)

Storage (the buffers' memory): TensorStorage, one tensor [layers, 2, capacity, kv_dim] from
PyTorch's allocator, reallocated when it grows (its address moves: `address()` changes and a
captured step keyed by it is captured again; capacity doubles unless exact). The scratch extent
(`scratch_row`) holds the rows dummy sequences of a padded batch read and write (zeros)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_store import PAGE_TOKENS, StoreLayout


class TensorStorage:
    """The pool's buffers as one tensor [layers, 2, capacity, kv_dim] (module docstring)."""

    def __init__(self, num_layers: int, kv_dim: int, dtype: torch.dtype, device, exact: bool = False):
        self.shape, self.dtype, self.device, self.exact = (num_layers, 2), dtype, torch.device(device), exact
        self.kv_dim = kv_dim
        self.t = torch.empty((num_layers, 2, 0, kv_dim), dtype=dtype, device=self.device)
        self.moves = 0

    @property
    def capacity(self) -> int:
        return self.t.shape[2]

    def ensure(self, rows: int, keep: int) -> None:
        """Hold at least `rows` rows (exactly, under a budget; else at least double), keeping the
        first `keep`; shrink to `rows` when exact."""
        cap = self.capacity
        want = rows if self.exact else (cap if rows <= cap else max(rows, 2 * cap))
        if want == cap:
            return
        new = torch.empty((*self.shape, want, self.kv_dim), dtype=self.dtype, device=self.device)
        k = min(keep, want, cap)
        new[:, :, :k].copy_(self.t[:, :, :k])
        self.t = new
        self.moves += 1

    def layer(self, i: int):
        return self.t[i, 0], self.t[i, 1]

    def release(self) -> None:
        self.t = torch.empty((*self.shape, 0, self.kv_dim), dtype=self.dtype, device=self.device)
        self.moves += 1

    def move(self, src: int, dst: int, rows: int) -> None:
        """Rows [src, src + rows) to [dst, dst + rows), dst < src: in pieces that never overlap."""
        step = src - dst
        for a in range(0, rows, step):
            n = min(step, rows - a)
            self.t[:, :, dst + a:dst + a + n].copy_(self.t[:, :, src + a:src + a + n])

    def zero(self, start: int, rows: int) -> None:
        self.t[:, :, start:start + rows].zero_()

    def address(self) -> tuple:
        return (self.t.data_ptr(), self.capacity, self.moves)

    @property
    def nbytes(self) -> int:
        return self.t.numel() * self.t.element_size()


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

    def pages_for(self, rows: int) -> int:
        return -(-rows // self.page_tokens)

    # -- allocation
    def allocate(self, rows: int) -> Extent:
        """An extent of whole pages holding `rows` rows (module docstring: first fit, compaction,
        growth)."""
        need = self.pages_for(max(1, rows))
        at = self._hole(need)
        if at is None and self._free_below_top() >= need:
            self._compact()
            at = self._hole(need)
        if at is None:
            at = self.top_page
            self.storage.ensure((at + need) * self.page_tokens, self.top_page * self.page_tokens)
        ext = Extent(at, need)
        self.extents.append(ext)
        self.extents.sort(key=lambda e: e.page)
        return ext

    def free(self, ext: Extent) -> None:
        """Give an extent's pages back (a request that left); under a budget the buffers shrink
        to the highest allocated page."""
        self.extents = [e for e in self.extents if e is not ext]
        if self.storage.exact:
            self.storage.ensure(self.top_page * self.page_tokens, self.top_page * self.page_tokens)

    def _hole(self, need: int) -> int | None:
        """The first free page run of `need` pages below the top, or None."""
        at = 0
        for e in self.extents:
            if e.page - at >= need:
                return at
            at = e.page + e.pages
        return None

    def _free_below_top(self) -> int:
        return self.top_page - self.allocated_pages

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

    def scratch_rows(self, n: int) -> int:
        """The first of at least n rows (zeros) that dummy sequences of a padded batch use."""
        if self.scratch is None or self.scratch.pages * self.page_tokens < n:
            if self.scratch is not None:
                self.free(self.scratch)
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
