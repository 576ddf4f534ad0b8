"""Block-sparse attention per layer range (opt-in, lossy): SparseRange, SparseConfig."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InputError
from .values import check_choice, check_int, coerce, disjoint_ranges, is_int, layer_range, range_for

SPARSE_PATTERNS = ("dense", "window", "topk", "global_local")
SPARSE_ESTIMATES = ("minmax", "rows", "mean")


@dataclass(frozen=True)
class SparseRange:
    """The attention pattern of a range of layers (block-sparse attention, opt-in and lossy).

    layers: (first, last), inclusive, 0-based; pattern: dense | window (each query block reads
    the `window` key blocks on each side of its own) | topk (the key blocks of highest pooled
    q·k score, `keep` of them as a fraction of all key blocks, always with the local window and
    the first `global_blocks`) | global_local (the first `global_blocks` plus the window)."""
    layers: tuple[int, int]
    pattern: str = "topk"
    keep: float = 0.2
    window: int = 1
    global_blocks: int = 1

    def __post_init__(self):
        object.__setattr__(self, "layers", layer_range("sparse", self.layers))
        check_choice("sparse ", "pattern", self.pattern, SPARSE_PATTERNS)
        if isinstance(self.keep, bool) or not isinstance(self.keep, (int, float)) or not 0 < self.keep <= 1:
            raise InputError(f"sparse keep={self.keep!r} must be in (0, 1] (a fraction of key blocks)")
        for name in ("window", "global_blocks"):
            check_int("sparse ", name, getattr(self, name), 0)


@dataclass(frozen=True)
class SparseConfig:
    """Block-sparse attention per layer range. block: rows (and keys) per block, a power of two
    >= 16; dense_steps: the first denoising steps of a request stay dense (SparseD: early steps
    decide the answer's layout); layers without a range stay dense. estimate: the topk block
    score's key side (kernels/sparse_select.py): minmax (channel-wise key bounds per block, an
    upper bound of the block's largest q·k, after Quest), rows (the same bounds against every
    query row instead of the pooled query: the few answer rows of a block keep their far blocks;
    1/block of the attention's FLOPs) or mean (the mean key of each block, which dilutes a single
    matching key: lossier on retrieval and copying)."""
    ranges: tuple[SparseRange, ...] = ()
    block: int = 128
    dense_steps: int = 1
    estimate: str = "minmax"

    def __post_init__(self):
        rs = tuple(r if isinstance(r, SparseRange) else coerce(SparseRange, r) for r in self.ranges)
        object.__setattr__(self, "ranges", rs)
        if not is_int(self.block) or self.block < 16 or self.block & (self.block - 1):
            raise InputError(f"sparse block={self.block!r} must be a power of two >= 16")
        check_int("sparse ", "dense_steps", self.dense_steps, 0)
        check_choice("sparse ", "estimate", self.estimate, SPARSE_ESTIMATES)
        disjoint_ranges("sparse", rs)

    def for_layer(self, layer: int) -> SparseRange | None:
        r = range_for(self.ranges, layer)
        return None if r is None or r.pattern == "dense" else r

    def max_keep(self, num_k_blocks: int) -> int:
        """The most key blocks any range keeps per query block (buffer sizes)."""
        return max((min(num_k_blocks, keep_count(r, num_k_blocks)) for r in self.ranges
                    if r.pattern != "dense"), default=1)

    @classmethod
    def coerce(cls, value) -> SparseConfig | None:
        return None if value is None else coerce(cls, value)


def keep_count(r: SparseRange, num_k_blocks: int) -> int:
    """Key blocks a query block reads under range r: the forced window and global blocks plus,
    for topk, enough top-scored blocks to reach keep * num_k_blocks."""
    forced = r.global_blocks + 2 * r.window + 1
    if r.pattern == "topk":
        return max(forced, math.ceil(r.keep * num_k_blocks - 1e-9))
    return forced

