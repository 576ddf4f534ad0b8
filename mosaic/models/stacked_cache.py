"""Block steps of several requests' block caches as one step (continuous batching of Fast-dLLM
requests, engine/batching.py).

Each request keeps its own store (memory/kv_store.py) and its own block position; a stacked
block step runs every request's block rows together: the projections and the FFN over all of
them at once (one read of the weights per step, not one per request), attention per sequence
over that sequence's own store, its fresh K/V written at that request's rows [lo, lo + n). The
step program is models/kv_cache.cached_program: it asks the spec for each sequence's K/V views
(`sequence_kv`), so one program serves a single store and a stack of them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    """The cache spec of a stacked block step: one Member per sequence (row) of the step, n block
    rows each; resident_bytes: the device bytes of every member store (admission and chunking
    charge them)."""
    members: tuple[Member, ...]
    n: int
    resident_bytes: int = 0
    mode: str = "block"
    store: object = None          # no single store (runtime/graphs.py reads it)

    def key(self) -> tuple:
        """A template depends on every sequence's key length (its attention's size)."""
        return ("kv-stack", self.n, tuple(m.length for m in self.members))

    def where(self) -> tuple:
        """The store rows the step writes (a captured step's addresses)."""
        return ("stack", tuple((m.lo, m.row, m.store.hot.data_ptr() if m.store is not None else 0)
                               for m in self.members))

    def _stores(self) -> list:
        seen, out = set(), []
        for m in self.members:
            if id(m.store) not in seen:
                seen.add(id(m.store))
                out.append(m.store)
        return out

    def sequence_kv(self, ctx, layer: int, batch: int, kv_dim: int) -> list[tuple]:
        """(K_b, V_b [L_b, kv_dim], lo_b) per sequence: views of its own store's layer (meta
        tensors when recording)."""
        held: dict = {}
        for store in self._stores():
            ctx.custom("kv_acquire", lambda s=store: held.update({id(s): s.acquire(layer)}))
        if not ctx.compute:
            meta = lambda m: torch.empty(m.length, kv_dim, dtype=ctx.dtype, device="meta")  # noqa: E731
            return [(meta(m), meta(m), m.lo) for m in self.members]
        out = []
        for m in self.members:
            K, V = held[id(m.store)]
            out.append((K[m.row], V[m.row], m.lo))
        return out

    def release_layer(self, ctx, layer: int) -> None:
        for store in self._stores():
            ctx.custom("kv_release", lambda s=store: s.release(layer, False))


def stacked_block_step(cfg, parts, dtype, **fields) -> Step:
    """The Step of several block steps: parts = [(ids [B_i, L_i] the request's whole canvas,
    valid_i [B_i, L_i] or None, lo_i, hi_i, store_i)], every hi_i - lo_i the same n. Each row's
    positions and left padding are its own request's. fields: rows (flat over the stacked
    B x n rows), reducer, offload."""
    ids, pos, pads, members = [], [], [], []
    n = parts[0][3] - parts[0][2]
    for ids_i, valid_i, lo, hi, store in parts:
        full = make_step(cfg, ids_i, valid_i, dtype=dtype)
        ids.append(ids_i[:, lo:hi])
        pos.append(full.positions[:, lo:hi])
        pads += list(full.pads) if full.pads else [0] * ids_i.shape[0]
        members += [Member(store, b, lo, ids_i.shape[1]) for b in range(ids_i.shape[0])]
    resident = sum(s.layout.device_bytes for s in {id(m.store): m.store for m in members}.values())
    spec = StackedBlocks(tuple(members), n, resident)
    return Step(torch.cat(ids), torch.cat(pos), pads=tuple(pads) if any(pads) else None, cache=spec, **fields)
