"""PyTorch's CUDA caching allocator, as far as a budget needs it: its rounding rules and a small
simulator of its block and segment decisions (the CPU tests' fake allocator).

Rules (c10/cuda/CUDACachingAllocator.cpp, defaults: expandable_segments off, no max_split_size,
no power-of-two rounding):
  - a request is rounded up to a multiple of 512 B (512 B at least);
  - requests of at most 1 MiB are served from the small pool, whose segments are 2 MiB;
    larger ones from the large pool, whose new segments are 20 MiB for requests under 10 MiB
    and the request rounded up to 2 MiB otherwise;
  - a request takes the smallest free cached block of its pool that holds it (best fit) and
    splits it when more than 512 B (small pool) or more than 1 MiB (large pool) would be left;
  - a freed block merges with free neighbours of its segment and stays cached (reserved);
  - with a per-process memory fraction set, a new segment that would take the reserved total
    over the limit is refused; the allocator then frees every cached segment that holds no live
    block and tries once more before raising out-of-memory.

Mosaic pre-charges every out-of-plan allocation of a step, so what the budget needs from these
rules is the size of one segment that holds all of a step's transients (`pool_bytes`) and the
footprint of a tensor when it needs a segment of its own (`segment_bytes`)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

KiB, MiB = 2**10, 2**20
MIN_BLOCK = 512                 # kMinBlockSize
SMALL_SIZE = 1 * MiB            # kSmallSize: largest request served by the small pool
SMALL_BUFFER = 2 * MiB          # kSmallBuffer: a small-pool segment
MIN_LARGE_ALLOC = 10 * MiB      # kMinLargeAlloc: from here a segment is the request rounded
ROUND_LARGE = 2 * MiB           # kRoundLarge
LARGE_BUFFER = 20 * MiB         # kLargeBuffer: the segment of a 1-10 MiB request
# rounding of up to 128 transients of one op to 512 B each: the pool's slack over the sum
POOL_SLACK = 64 * KiB


def round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def round_size(nbytes: int) -> int:
    """A request's size as the allocator books it (multiple of 512 B, 512 B at least)."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else round_up(nbytes, MIN_BLOCK)


def is_small(nbytes: int) -> bool:
    return round_size(nbytes) <= SMALL_SIZE


def segment_bytes(nbytes: int) -> int:
    """The segment a request gets when no cached block holds it (cudaMalloc size)."""
    size = round_size(nbytes)
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return round_up(size, ROUND_LARGE)


def pool_bytes(transient_bytes: int) -> int:
    """The one large segment pre-reserved for a step whose ops allocate at most
    `transient_bytes` outside the plan at once: at least 10 MiB (so that it is one segment of
    exactly this size, not a 20 MiB one), rounded to 2 MiB, with slack for 512 B rounding."""
    if transient_bytes <= 0:
        return 0
    return round_up(max(transient_bytes + POOL_SLACK, MIN_LARGE_ALLOC), ROUND_LARGE)


class SimOOM(MemoryError):
    """The simulated allocator could not serve a request within its limit."""


@dataclass
class _Block:
    seg: int
    offset: int
    size: int
    free: bool = True


@dataclass
class SimAllocator:
    """A model of the caching allocator's decisions for one stream (CPU tests).

    malloc(n) -> block id; free(id); empty_cache(); reserve(n) allocates and frees n bytes (a
    cached segment for later requests); limit: the per-process fraction times the card (bytes,
    None for none). reserved / allocated / peak_reserved in bytes; segments_created counts
    cudaMalloc calls."""
    limit: int | None = None
    segments: dict = field(default_factory=dict)       # seg id -> (size, small?)
    blocks: dict = field(default_factory=dict)         # block id -> _Block
    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    segments_created: int = 0
    on_pressure: object = None     # called before giving up (frees other pools; may lift limit)
    _next: int = 0

    def _free_blocks(self, small: bool):
        return sorted(((b.size, bid) for bid, b in self.blocks.items()
                       if b.free and self.segments[b.seg][1] == small))

    def malloc(self, nbytes: int) -> int:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        bid = self._best_fit(size, small)
        if bid is None:
            bid = self._new_segment(segment_bytes(nbytes), small)
        return self._take(bid, size, small)

    def _best_fit(self, size: int, small: bool):
        free = self._free_blocks(small)
        i = bisect.bisect_left(free, (size, -1))
        return free[i][1] if i < len(free) else None

    def _new_segment(self, seg_size: int, small: bool) -> int:
        if self.limit is not None and self.reserved + seg_size > self.limit:
            self.empty_cache()      # the allocator's retry: free cached segments, try again
            if self.on_pressure is not None:
                self.on_pressure()
            if self.reserved + seg_size > self.limit:
                raise SimOOM(f"segment of {seg_size} B over the limit {self.limit} "
                             f"({self.reserved} B reserved, {self.allocated} B allocated)")
        sid = self._next
        self._next += 1
        self.segments[sid] = (seg_size, small)
        self.reserved += seg_size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.segments_created += 1
        bid = self._next
        self._next += 1
        self.blocks[bid] = _Block(sid, 0, seg_size)
        return bid

    def _take(self, bid: int, size: int, small: bool) -> int:
        b = self.blocks[bid]
        rest = b.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            nid = self._next
            self._next += 1
            self.blocks[nid] = _Block(b.seg, b.offset + size, rest)
            b.size = size
        b.free = False
        self.allocated += b.size
        return bid

    def free(self, bid: int) -> None:
        b = self.blocks[bid]
        assert not b.free, "double free"
        b.free = True
        self.allocated -= b.size
        for other_id, o in list(self.blocks.items()):   # merge with free neighbours
            if other_id == bid or not o.free or o.seg != b.seg:
                continue
            if o.offset + o.size == b.offset or b.offset + b.size == o.offset:
                b.offset, b.size = min(b.offset, o.offset), b.size + o.size
                del self.blocks[other_id]

    def empty_cache(self) -> None:
        """Free every segment that is one free block (torch.cuda.empty_cache)."""
        for bid, b in list(self.blocks.items()):
            size, _ = self.segments[b.seg]
            if b.free and b.size == size:
                del self.blocks[bid]
                del self.segments[b.seg]
                self.reserved -= size

    def reserve(self, nbytes: int) -> None:
        """Allocate and free: the caching allocator keeps the segment for later requests."""
        if nbytes > 0:
            self.free(self.malloc(nbytes))

    def largest_free(self, small: bool = False) -> int:
        free = self._free_blocks(small)
        return free[-1][0] if free else 0
