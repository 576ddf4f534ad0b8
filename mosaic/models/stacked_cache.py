"""Block steps of several requests' block caches as one step (continuous batching of Fast-dLLM
requests, engine/batching.py).

Each request keeps its own store (memory/kv_store.py) and its own block position; a stacked
block step runs every request's block rows together: the projections and the FFN over all of
them at once (one read of the weights per step, not one per request), and attention over every
sequence in one call (models/batched_attention.py) when the stores live in one paged pool
(memory/kv_pool.py): each sequence's block of query rows against its own keys where they lie in
the pool, its fresh K/V written at its own rows, both through a BatchIndex. Stores outside a
common pool fall back to one attention per sequence over its own store (`sequence_kv`).

Padding to a batch bucket (a captured step's shape, runtime/graph_buckets.py): `pad_to` rows
beyond the real sequences are dummies that write and read only the pool's scratch rows; their
outputs are never read (no masked row of theirs is asked for)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..kernels.host_ints import ints_on
from .batched_attention import BatchIndex, batch_index
from .step import Step, make_step


@dataclass(frozen=True)
class Member:
    """One sequence of a stacked block step: its store, its row in that store, the store row its
    block starts at and the store's length (keys per sequence)."""
    store: object
    row: int
    lo: int
    length: int


@dataclass(frozen=True)
class StackedBlocks:
    """The cache spec of a stacked block step: one Member per real sequence of the step, n block
    rows each; resident_bytes: the device bytes of every member store (admission and chunking
    charge them); pool: the paged pool every member's store lives in (None: stores of their
    own, attention per sequence); index: the pooled step's BatchIndex (dummies included)."""
    members: tuple[Member, ...]
    n: int
    resident_bytes: int = 0
    mode: str = "block"
    store: object = None          # no single store (runtime/graphs.py reads it)
    pool: object = None
    index: BatchIndex | None = None

    def key(self) -> tuple:
        """A template depends on the block rows and, pooled, the bound on keys per sequence (the
        loop kernel's workspace); per store, on every sequence's key length."""
        if self.index is not None:
            return ("kv-pool", self.n, self.index.kernel, self.index.entries.max_k)
        return ("kv-stack", self.n, tuple(m.length for m in self.members))

    def where(self) -> tuple:
        """What a captured step's addresses depend on: the pool's buffers (pooled: every row
        offset is a graph input), or each member's store rows."""
        if self.index is not None:
            return ("pool", self.pool.address(), self.index.fixed())
        return ("stack", tuple((m.lo, m.row, m.store.address() if m.store is not None else 0)
                               for m in self.members))

    def _stores(self) -> list:
        seen, out = set(), []
        for m in self.members:
            if id(m.store) not in seen:
                seen.add(id(m.store))
                out.append(m.store)
        return out

    def _acquire(self, ctx, layer: int) -> dict:
        held: dict = {}
        for store in self._stores():
            ctx.custom("kv_acquire", lambda s=store: held.update({id(s): s.acquire(layer)}))
        return held

    def sequence_kv(self, ctx, layer: int, batch: int, kv_dim: int) -> list[tuple]:
        """(K_b, V_b [L_b, kv_dim], lo_b) per sequence: views of its own store's layer (meta
        tensors when recording)."""
        held = self._acquire(ctx, layer)
        if not ctx.compute:
            meta = lambda m: torch.empty(m.length, kv_dim, dtype=ctx.dtype, device="meta")  # noqa: E731
            return [(meta(m), meta(m), m.lo) for m in self.members]
        return [(held[id(m.store)][0][m.row], held[id(m.store)][1][m.row], m.lo) for m in self.members]

    def shared_kv(self, ctx, layer: int, kv_dim: int):
        """(K, V) [R, kv_dim]: the pool's layer (None without a common pool)."""
        if self.index is None:
            return None
        self._acquire(ctx, layer)
        if not ctx.compute:
            rows = max(1, self.pool.rows) if self.pool is not None else 1
            return (torch.empty(rows, kv_dim, dtype=ctx.dtype, device="meta"),
                    torch.empty(rows, kv_dim, dtype=ctx.dtype, device="meta"))
        return self.pool.layer(layer)

    def release_layer(self, ctx, layer: int) -> None:
        for store in self._stores():
            ctx.custom("kv_release", lambda s=store: s.release(layer, False))

    def graph_inputs(self) -> dict:
        return {} if self.index is None else self.index.tensors()

    def with_graph_inputs(self, t: dict) -> StackedBlocks:
        return self if self.index is None else replace(self, index=self.index.with_tensors(t))


def common_pool(stores):
    """The paged pool every store lives in, or None."""
    pools = {id(getattr(s, "pool", None)): getattr(s, "pool", None) for s in stores}
    return next(iter(pools.values())) if len(pools) == 1 else None


def _positions(parts: list, device) -> torch.Tensor:
    """[sum] int64 on device: parts (lists of host ints, or device tensors) concatenated, every
    run of host ints in one queued copy (kernels/host_ints.py)."""
    out, host = [], []
    for p in parts:
        if isinstance(p, list):
            host += p
            continue
        if host:
            out.append(ints_on(host, device))
            host = []
        out.append(p)
    if host:
        out.append(ints_on(host, device))
    return out[0] if len(out) == 1 else torch.cat(out)


def stacked_block_step(cfg, parts, dtype, pad_to: int | None = None, max_k: int | None = None,
                       kernel: str = "loop", row_pads=None, **fields) -> Step:
    """The Step of several block steps: parts = [(ids [B_i, L_i] the request's whole canvas,
    valid_i [B_i, L_i] or None, lo_i, hi_i, store_i)], every hi_i - lo_i the same n. Each row's
    positions and left padding are its own request's. pad_to: rows of the step (dummies beyond
    the real ones, pooled only); max_k: the bound on keys per sequence (a captured step's
    bucket); kernel: the attention kernel (kernels.varlen_kernel); row_pads: per part its
    rows' left padding as host ints, or None (read from valid_i). fields: rows (flat over the
    stacked B x n rows), reducer, offload. Nothing is read from the device where the pads are
    given, and host-built tensors are queued, not copied blocking (kernels/host_ints.py)."""
    ids, pos, pads, members = [], [], [], []
    n = parts[0][3] - parts[0][2]
    dev = parts[0][0].device
    for i, (ids_i, valid_i, lo, hi, store) in enumerate(parts):
        ids.append(ids_i[:, lo:hi])
        if valid_i is None:      # unpadded: make_step's positions 0..L-1, Python ints (no ATen call)
            pos.append(list(range(lo, hi)) * ids_i.shape[0])
            pads += [0] * ids_i.shape[0]
        else:
            full = make_step(cfg, ids_i, valid_i, dtype=dtype, row_pads=row_pads[i] if row_pads else None)
            pos.append(full.positions[:, lo:hi].reshape(-1))
            pads += list(full.pads) if full.pads else [0] * ids_i.shape[0]
        members += [Member(store, b, lo, ids_i.shape[1]) for b in range(ids_i.shape[0])]
    stores = {id(m.store): m.store for m in members}.values()
    pool = common_pool(stores)
    # under a budget the pool's whole buffers are held (free capacity too: memory/kv_pool.py)
    resident = max(sum(s.layout.device_bytes for s in stores), getattr(pool, "held_bytes", 0))
    ids = torch.cat(ids)
    if pool is None:
        spec = StackedBlocks(tuple(members), n, resident)
        return Step(ids, _positions(pos, dev).view(-1, n), pads=tuple(pads) if any(pads) else None, cache=spec,
                    **fields)
    dummies = max(0, (pad_to or 0) - len(members))
    scratch = pool.scratch_rows(n) if dummies else 0            # dummies read and write only these rows
    if scratch is None:          # under a budget no free pages hold them: unpadded (memory/kv_pool.py)
        dummies, scratch = 0, 0
    starts = [m.store.first_row + m.row * m.length for m in members] + [scratch] * dummies
    lengths = [m.length for m in members] + [n] * dummies
    index = batch_index(starts, lengths, pads + [0] * dummies, [m.lo for m in members] + [0] * dummies, n,
                        ids.device, max_k, kernel)
    if dummies:
        ids = torch.cat([ids, ids[-1:].expand(dummies, n)])
        pos.append(list(range(n)) * dummies)
    spec = StackedBlocks(tuple(members), n, resident, pool=pool, index=index)
    return Step(ids, _positions(pos, dev).view(-1, n), cache=spec, **fields)
