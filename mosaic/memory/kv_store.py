"""The persistent K/V of a block cache: hot layers on the device, cold layers in host memory.

One request's store holds, per layer, K and V of every position: [B, L, kv_dim] each (the
block's own rows are rewritten by every block step, so attention reads one contiguous key
range). Layers [0, hot) live on the device for the whole request. Layers [hot, num_layers) live
in host memory (pinned when CUDA is there) and pass through `slots` device staging buffers:

  fill step   layer i computes into a slot; release(i) copies the slot to the host on a side
              stream; the slot is reused two cold layers later, after that copy has finished
  block step  the rows the step does not compute ([0, lo) and, dual, [hi, L)) are prefetched
              into a slot on the side stream while earlier layers compute; acquire(i) makes
              the compute stream wait for them; release(i) frees the slot for the next cold layer

On the CPU the same code runs with synchronous copies (the 'host' tier of the CPU tests).
Transfer per cold layer and block step: 2 * B * (L - block rows) * kv_dim * itemsize bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

SLOTS = 2   # double buffering: one slot computes while the next layer's K/V arrive
PAGE_TOKENS = 16   # a device-tier store's rows are charged (and pooled: allocated) in pages of this many


@dataclass(frozen=True)
class StoreLayout:
    """Where a request's K/V live: `hot` layers on the device, the rest on the host through
    `slots` device staging buffers (slots = 0 when every layer is hot). page: the rows (tokens)
    are counted in whole pages of this many (a device-tier store: memory/kv_pool.py allocates
    exactly that many rows)."""
    num_layers: int
    batch: int
    length: int
    kv_dim: int
    itemsize: int
    hot: int
    page: int = 1

    @property
    def rows(self) -> int:
        """The store's rows (B x L tokens) rounded up to whole pages."""
        return -(-self.batch * self.length // self.page) * self.page

    @property
    def layer_bytes(self) -> int:
        """K and V of one layer (bytes)."""
        return 2 * self.rows * self.kv_dim * self.itemsize

    @property
    def slots(self) -> int:
        return 0 if self.hot >= self.num_layers else min(SLOTS, self.num_layers - self.hot)

    @property
    def device_bytes(self) -> int:
        """Device bytes held for the whole request: hot layers + staging slots."""
        return (min(self.hot, self.num_layers) + self.slots) * self.layer_bytes

    @property
    def host_bytes(self) -> int:
        return max(0, self.num_layers - self.hot) * self.layer_bytes

    @property
    def tier(self) -> str:
        return "device" if self.hot >= self.num_layers else ("host" if self.hot == 0 else "split")

    def with_page(self, page: int) -> StoreLayout:
        return dataclasses.replace(self, page=page)

    @classmethod
    def of(cls, cfg, batch: int, length: int, itemsize: int, hot: int | None = None) -> StoreLayout:
        """Every layer hot when hot is None; a device-tier layout counts whole pages."""
        n = cfg.num_layers
        hot = n if hot is None else max(0, min(n, hot))
        return cls(n, batch, length, cfg.kv_dim, itemsize, hot, PAGE_TOKENS if hot >= n else 1)


class KVStore:
    """The buffers of one StoreLayout on `device` (host layers on the CPU), with the per-layer
    protocol the cached step program calls: begin(mode, lo, hi) at the start of a step,
    acquire(i) -> (K, V) [B, L, kv_dim] device views, release(i, wrote), finish()."""
    pool = None          # a store of its own, not in a paged pool (memory/kv_pool.py)

    def __init__(self, layout: StoreLayout, device: torch.device, dtype: torch.dtype):
        self.layout, self.device, self.dtype = layout, torch.device(device), dtype
        shape = (2, layout.batch, layout.length, layout.kv_dim)
        self.hot = torch.empty((layout.hot, *shape), dtype=dtype, device=self.device)
        cold = layout.num_layers - layout.hot
        cuda = self.device.type == "cuda"
        self.host = torch.empty((cold, *shape), dtype=dtype, device="cpu", pin_memory=cuda and cold > 0)
        self.slots = torch.empty((layout.slots, *shape), dtype=dtype, device=self.device)
        self.stream = torch.cuda.Stream(self.device) if cuda and cold else None
        self._ready = [None] * layout.slots      # event: prefetch into the slot done
        self._free = [None] * layout.slots       # event: the slot's last reader / write-back done
        self.mode, self.ranges = "fill", ()
        self.transfer_bytes = 0                  # bytes copied between host and device so far
        self.readers: set[str] = set()           # batched attention kernels that read it (kernels/varlen.py)

    def read_by(self, kernel: str) -> None:
        """Note a batched attention kernel that ran over this store (Generation.lossy names it)."""
        self.readers.add(kernel)

    def address(self) -> int:
        """Where the store's device rows are (a captured step's key)."""
        return self.hot.data_ptr() if self.hot.numel() else self.slots.data_ptr()

    def close(self) -> None:
        """Nothing to give back: the store's tensors go with it."""

    # -- protocol
    def begin(self, mode: str, lo: int = 0, hi: int = 0) -> None:
        """Start a step. mode 'fill' computes every row; 'block' computes rows [lo, hi) and
        reads the others from the store (prefetched from the host for cold layers)."""
        self.mode = mode
        L = self.layout.length
        self.ranges = tuple(r for r in ((0, lo), (hi, L)) if r[1] > r[0]) if mode == "block" else ()
        if mode == "block":
            for j in range(min(self.layout.slots, self._cold_count())):
                self._prefetch(self.layout.hot + j)

    def acquire(self, layer: int):
        if layer < self.layout.hot:
            kv = self.hot[layer]
            return kv[0], kv[1]
        slot = self._slot(layer)
        cur = torch.cuda.current_stream(self.device) if self.stream is not None else None
        if cur is not None:
            ev = self._ready[slot] if self.mode == "block" else self._free[slot]
            if ev is not None:
                cur.wait_event(ev)
        kv = self.slots[slot]
        return kv[0], kv[1]

    def release(self, layer: int, wrote: bool) -> None:
        """After layer `layer`'s attention: write a filled cold layer back to the host, then
        start the prefetch that reuses its slot (block steps)."""
        if layer < self.layout.hot:
            return
        slot, c = self._slot(layer), layer - self.layout.hot
        if wrote:
            self._copy(self.host[c], self.slots[slot], slot, ranges=None, to_host=True)
        elif self.stream is not None:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._free[slot] = ev
        nxt = layer + self.layout.slots
        if self.mode == "block" and nxt < self.layout.num_layers:
            self._prefetch(nxt)

    def finish(self) -> None:
        """End of a step: the compute stream waits for every outstanding write-back."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    # -- internals
    def _cold_count(self) -> int:
        return self.layout.num_layers - self.layout.hot

    def _slot(self, layer: int) -> int:
        return (layer - self.layout.hot) % max(1, self.layout.slots)

    def _prefetch(self, layer: int) -> None:
        c, slot = layer - self.layout.hot, self._slot(layer)
        self._copy(self.slots[slot], self.host[c], slot, ranges=self.ranges, to_host=False)

    def _copy(self, dst, src, slot: int, ranges, to_host: bool) -> None:
        """dst <- src over the row ranges (None: every row), on the side stream after the
        slot's last use; records the slot's ready (prefetch) or free (write-back) event."""
        parts = [(dst, src)] if ranges is None else \
            [(dst[:, :, a:b], src[:, :, a:b]) for a, b in ranges]
        if self.stream is None:
            for d, s in parts:
                d.copy_(s)
                self.transfer_bytes += s.numel() * s.element_size()
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(done)           # the slot's compute (or last read) is over
            prev = self._free[slot]
            if prev is not None and not to_host:
                self.stream.wait_event(prev)
            for d, s in parts:
                if ranges is None or d.is_contiguous():
                    d.copy_(s, non_blocking=True)
                else:                              # a strided row range: one copy per (kind, row)
                    for kk in range(d.shape[0]):
                        for b in range(d.shape[1]):
                            d[kk, b].copy_(s[kk, b], non_blocking=True)
                self.transfer_bytes += s.numel() * s.element_size()
            ev = torch.cuda.Event()
            ev.record(self.stream)
        if to_host:
            self._free[slot] = ev
        else:
            self._ready[slot] = ev
