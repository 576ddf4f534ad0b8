"""Row ranges: chunk bounds, and a rank's share of every sequence under sequence parallelism.

These are the primitives the step program and the ctx ops are written with; the process-group
glue (which slots a rank owns, gathering results) sits above, in runtime/parallel.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import InputError

# A peer's K/V arrive in pieces of this many rows: receive buffers stay small (LLaDA-8B: 16,384
# rows x 8 KiB = 128 MiB for K and V together) while each piece is still a large attention call.
PEER_ROWS = 16384


def chunk_bounds(n: int, num_chunks: int, allow_empty: bool = False) -> list[tuple[int, int]]:
    """num_chunks near-equal row ranges [start, end) covering range(n), the first ones one row
    longer; without allow_empty there are at most n of them (never an empty range)."""
    num_chunks = max(1, num_chunks if allow_empty else min(num_chunks, max(n, 1)))
    base, extra = divmod(n, num_chunks)
    out, s = [], 0
    for i in range(num_chunks):
        e = s + base + (1 if i < extra else 0)
        out.append((s, e))
        s = e
    return out


@dataclass(frozen=True)
class Shard:
    """This rank's contiguous slice [lo, hi) of every sequence's positions.

    bounds: [lo, hi) of each rank; piece_rows: rows per broadcast piece of a peer's K/V shard."""
    rank: int
    world: int
    bounds: tuple[tuple[int, int], ...]
    group: object = None
    piece_rows: int = PEER_ROWS

    @property
    def lo(self) -> int:
        return self.bounds[self.rank][0]

    @property
    def hi(self) -> int:
        return self.bounds[self.rank][1]

    @property
    def rows(self) -> int:
        return self.hi - self.lo

    @property
    def max_rows(self) -> int:
        return max(b - a for a, b in self.bounds)

    @classmethod
    def of(cls, length: int, rank: int, world: int, group=None, piece_rows: int = PEER_ROWS) -> Shard:
        """Raises InputError when the sequence has fewer positions than there are ranks."""
        if length < world:
            raise InputError(f"a sequence of {length} tokens cannot be split over {world} processes; "
                             f"use at least {world} tokens or fewer processes")
        return cls(rank, world, tuple(chunk_bounds(length, world)), group, piece_rows)


def world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def current(length: int, piece_rows: int = PEER_ROWS) -> Shard | None:
    """The shard of this process when torch.distributed runs with several ranks, else None."""
    rank, size = world()
    if size == 1:
        return None
    return Shard.of(length, rank, size, piece_rows=piece_rows)


def broadcast(t: torch.Tensor, src: int, shard: Shard) -> None:
    dist.broadcast(t, src=src, group=shard.group)
