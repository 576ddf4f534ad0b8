"""Row ranges: chunk bounds, and a rank's share of every sequence under sequence parallelism.

These are the primitives the step program and the ctx ops are written with; the process-group
glue (which slots a rank owns, gathering results) sits above, in runtime/parallel.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import InputError

# A peer's K/V arrive in pieces of at most this many rows (fewer when the attention's query
# chunks are smaller: a piece never has more rows than a query chunk). LLaDA-8B: 16,384 rows x
# 16 KiB (K and V, 8 KiB each) = 256 MiB per receive slot, two slots when transfers overlap.
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

    bounds: [lo, hi) of each rank; piece_rows: the most rows per broadcast piece of a peer's K/V
    shard; overlap: the next piece travels while the current one is attended (two receive slots),
    else one slot and every transfer completes before its piece is used (same arithmetic)."""
    rank: int
    world: int
    bounds: tuple[tuple[int, int], ...]
    group: object = None
    piece_rows: int = PEER_ROWS
    overlap: bool = True

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

    @property
    def slots(self) -> int:
        """Receive slots per K and V: two when transfers overlap compute, else one."""
        return 2 if self.overlap else 1

    def lead(self) -> Shard:
        """Rank 0's shard: the largest (chunk_bounds gives the first ranks the extra row). Every
        rank chooses its chunk counts for this one, so that all ranks run the same rounds of
        collectives."""
        return dataclasses.replace(self, rank=0)

    def piece(self, query_rows: int) -> int:
        """Rows per piece of a peer's shard when query chunks hold up to query_rows rows: the
        same on every rank (from max_rows and the common chunk count), at least 1."""
        return max(1, min(self.piece_rows, self.max_rows, query_rows))

    def pieces(self, piece: int) -> list[tuple[int, int, int]]:
        """The broadcast schedule, identical on every rank: (source rank, start, end) rows of the
        source's shard, source by source, each shard cut into near-equal pieces of <= piece rows."""
        out = []
        for src, (lo, hi) in enumerate(self.bounds):
            n = hi - lo
            out += [(src, a, b) for a, b in chunk_bounds(n, -(-n // piece))]
        return out

    @classmethod
    def of(cls, length: int, rank: int, world: int, group=None, piece_rows: int = PEER_ROWS,
           overlap: bool = True) -> Shard:
        """Raises InputError when the sequence has fewer positions than there are ranks."""
        if length < world:
            raise InputError(f"a sequence of {length} tokens cannot be split over {world} processes; "
                             f"use at least {world} tokens or fewer processes")
        return cls(rank, world, tuple(chunk_bounds(length, world)), group, piece_rows, overlap)


def world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def current(length: int, piece_rows: int = PEER_ROWS, overlap: bool = True) -> Shard | None:
    """The shard of this process when torch.distributed runs with several ranks, else None."""
    rank, size = world()
    if size == 1:
        return None
    return Shard.of(length, rank, size, piece_rows=piece_rows, overlap=overlap)


def broadcast(t: torch.Tensor, src: int, shard: Shard, async_op: bool = False):
    """Rank src's t into every rank's t (contiguous, same shape everywhere). async_op: returns
    the work handle to wait() on (NCCL: the transfer runs on NCCL's stream, and wait() makes the
    current stream wait for it; gloo: it runs on gloo's threads and wait() blocks); else None."""
    if t.numel() == 0:
        return None
    return dist.broadcast(t, src=src, group=shard.group, async_op=async_op)
