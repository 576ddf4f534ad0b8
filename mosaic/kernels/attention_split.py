"""Split-K planning for the attention kernel (flash-decoding): how many key splits a call uses
and the workspace their partials need, as pure functions of the shapes.

When few query blocks x heads would leave the 132 SMs of an H200 idle (a chunk of 400 query
rows x 32 heads is 128 programs), the key range is cut into S splits, each writing a normalised
partial output and its log-sum-exp to a workspace, merged afterwards. S and the workspace are
pure functions of (nq, Hq, Nk) / (nq, Hq, hd, Nk), independent of the GPU and of the autotuned
block size, so the memory planner can reserve the bytes ahead.
"""

from __future__ import annotations

import functools

NOMINAL_BLOCK_M = 128     # query rows per program assumed when counting programs
NOMINAL_SMS = 132         # H200; one 8-warp program of 128 rows per SM at a time
SPLIT_BELOW = 2 * NOMINAL_SMS      # split only when fewer programs than two waves
MAX_PROGRAMS = 8 * NOMINAL_SMS     # split programs at most: bounds the workspace (70 MiB at hd 128)
MIN_SPLIT_KEYS = 1024     # a split reads >= 8 key blocks of 128: its partial write is < 1% of its reads
MAX_SPLITS = 32


@functools.lru_cache(maxsize=4096)
def num_splits(nq: int, hq: int, nk: int) -> int:
    """Key splits S for a call (flash-decoding split-K). With P = cdiv(nq, 128) * Hq programs,
    a full-key program's time as unit and one program per SM, S splits take ceil(P*S/132) / S;
    S is the smallest within 10% of the best S <= min(32, 1056 / P, Nk / 1024), and 1 when
    P >= 264. E.g. 400 rows x 32 heads: P = 128 -> S = 1 (one wave, 97% full); 128 rows x
    32 heads: P = 32 -> S = 4."""
    programs = -(-nq // NOMINAL_BLOCK_M) * hq
    if programs == 0 or programs >= SPLIT_BELOW:
        return 1
    limit = max(1, min(MAX_SPLITS, MAX_PROGRAMS // programs, nk // MIN_SPLIT_KEYS))
    cost = {s: -(-programs * s // NOMINAL_SMS) / s for s in range(1, limit + 1)}
    best = min(cost.values())
    return min(s for s, c in cost.items() if c <= 1.1 * best)


def split_workspace_elems(nq: int, hq: int, hd: int, splits: int) -> int:
    """fp32 elements of the partials: o [S, Hq, nq, hd] then lse [S, Hq, nq]; 0 when S = 1."""
    return splits * hq * nq * (hd + 1) if splits > 1 else 0


def workspace_bytes(nq: int, hq: int, hd: int, nk: int) -> int:
    """Bytes of split-K workspace an attention_into call of up to nq query rows needs (0 when
    none splits). Monotone in nq and Nk: the maximum over every chunk of nq' <= nq rows (the
    largest chunk of each block count is the worst of it), so a plan for nq covers smaller chunks. At
    most 4 * 1056 * 128 * (hd + 1) bytes: 70 MiB for hd 128 (S * P <= 1056 programs)."""
    worst = 0
    for blocks in range(1, min(-(-nq // NOMINAL_BLOCK_M), SPLIT_BELOW) + 1):  # beyond: S = 1
        rows = min(nq, blocks * NOMINAL_BLOCK_M)
        worst = max(worst, split_workspace_elems(rows, hq, hd, num_splits(rows, hq, nk)))
    return 4 * worst
