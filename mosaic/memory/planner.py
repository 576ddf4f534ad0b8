"""Offset planners: place buffers with lifetimes in one workspace so that co-live ones never overlap.

All planners take parallel lists (sizes, starts, ends) with inclusive op-index lifetimes and
return a Plan. LOAD, the max over time of live bytes, is a lower bound for every planner; the
ILP is exact up to its time limit; brute force is exact for <= 8 buffers (every placement order
with lowest-offset placement includes an optimum: push any optimal layout down in offset order).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

from ..config import PLANNER_CHOICES
from ..errors import InputError

ALIGN = 256  # bytes: CUDA's allocation alignment, enough for 16-byte vector loads of any view

PLANNERS = (*PLANNER_CHOICES, "brute")  # brute force: exact, <= 8 buffers (tests)


@dataclass(frozen=True)
class Plan:
    offsets: tuple[int, ...]
    total_bytes: int
    load_bytes: int
    planner: str
    plan_ms: float
    optimal: bool = False

    @property
    def over_load(self) -> float:
        return self.total_bytes / self.load_bytes - 1 if self.load_bytes else 0.0


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def load_bytes(sizes, starts, ends) -> int:
    if not sizes:
        return 0
    horizon = max(ends) + 2
    diff = np.zeros(horizon, dtype=np.int64)
    np.add.at(diff, np.asarray(starts), np.asarray(sizes, dtype=np.int64))
    np.add.at(diff, np.asarray(ends) + 1, -np.asarray(sizes, dtype=np.int64))
    return int(np.cumsum(diff).max())


def _place(order, sizes, starts, ends, best_fit: bool) -> list[int]:
    """Place buffers in `order`, each at the smallest (best_fit) or lowest fitting gap among the
    already placed buffers whose lifetimes overlap it."""
    n = len(sizes)
    off = np.full(n, -1, dtype=np.int64)
    st, en, sz = np.asarray(starts), np.asarray(ends), np.asarray(sizes, dtype=np.int64)
    placed = np.zeros(n, dtype=bool)
    for i in order:
        conflict = placed & (st <= en[i]) & (en >= st[i])
        idx = np.nonzero(conflict)[0]
        if idx.size == 0:
            off[i] = 0
        else:
            lo, hi = off[idx], off[idx] + sz[idx]
            o = np.argsort(lo, kind="stable")
            lo, hi = lo[o], hi[o]
            top = np.maximum.accumulate(hi)                   # highest end so far
            gap_start = np.concatenate(([0], top))            # free from here ...
            gap_end = np.concatenate((lo, [np.iinfo(np.int64).max]))  # ... up to the next start
            width = gap_end - gap_start
            ok = np.nonzero(width >= sz[i])[0]
            pick = ok[np.argmin(width[ok])] if best_fit else ok[0]
            off[i] = gap_start[pick]
        placed[i] = True
    return off.tolist()


def _finish(name, offsets, sizes, starts, ends, t0, optimal=False) -> Plan:
    total = max((o + s for o, s in zip(offsets, sizes)), default=0)
    return Plan(tuple(int(o) for o in offsets), int(total), load_bytes(sizes, starts, ends), name,
                (time.perf_counter() - t0) * 1e3, optimal)


def first_fit(sizes, starts, ends) -> Plan:
    t0 = time.perf_counter()
    order = sorted(range(len(sizes)), key=lambda i: (starts[i], -sizes[i]))
    return _finish("first-fit", _place(order, sizes, starts, ends, False), sizes, starts, ends, t0)


def greedy_size(sizes, starts, ends) -> Plan:
    t0 = time.perf_counter()
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], starts[i] - ends[i], starts[i]))
    return _finish("greedy-size", _place(order, sizes, starts, ends, True), sizes, starts, ends, t0)


def best(sizes, starts, ends) -> Plan:
    t0 = time.perf_counter()
    keys = [lambda i: (-sizes[i], starts[i]),
            lambda i: (starts[i], -sizes[i]),
            lambda i: (starts[i] - ends[i], -sizes[i]),
            lambda i: (-sizes[i] * (ends[i] - starts[i] + 1), starts[i])]
    best_off, best_total = None, None
    for key, fit in itertools.product(keys, (True, False)):
        off = _place(sorted(range(len(sizes)), key=key), sizes, starts, ends, fit)
        total = max((o + s for o, s in zip(off, sizes)), default=0)
        if best_total is None or total < best_total:
            best_off, best_total = off, total
    return _finish("best", best_off, sizes, starts, ends, t0)


def brute(sizes, starts, ends) -> Plan:
    if len(sizes) > 8:
        raise InputError(f"the brute-force planner handles at most 8 buffers (every order is tried); this "
                         f"template has {len(sizes)}; use one of {PLANNER_CHOICES}")
    t0 = time.perf_counter()
    best_off, best_total = [], None
    for order in itertools.permutations(range(len(sizes))):
        off = _place(order, sizes, starts, ends, False)
        total = max((o + s for o, s in zip(off, sizes)), default=0)
        if best_total is None or total < best_total:
            best_off, best_total = off, total
    return _finish("brute", best_off, sizes, starts, ends, t0, optimal=True)


def ilp(sizes, starts, ends, time_limit: float = 10.0) -> Plan:
    """min T s.t. o_i + s_i <= T and, for each co-live pair, one is above the other (big-M with
    M = the best heuristic's total). Falls back to that heuristic if HiGHS finds nothing better."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    t0 = time.perf_counter()
    n = len(sizes)
    warm = best(sizes, starts, ends)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)
             if starts[i] <= ends[j] and starts[j] <= ends[i]]
    if not pairs:
        return _finish("ilp", [0] * n, sizes, starts, ends, t0, optimal=True)
    big = warm.total_bytes
    nv = n + 1 + len(pairs)             # offsets, T, one binary per pair
    rows, lo, hi = [], [], []
    for i in range(n):                  # o_i + s_i - T <= 0
        r = np.zeros(nv)
        r[i], r[n] = 1, -1
        rows.append(r), lo.append(-np.inf), hi.append(-sizes[i])
    for p, (i, j) in enumerate(pairs):  # z=1: i below j ; z=0: j below i
        z = n + 1 + p
        r = np.zeros(nv)
        r[i], r[j], r[z] = 1, -1, big
        rows.append(r), lo.append(-np.inf), hi.append(big - sizes[i])
        r = np.zeros(nv)
        r[j], r[i], r[z] = 1, -1, -big
        rows.append(r), lo.append(-np.inf), hi.append(-sizes[j])
    c = np.zeros(nv)
    c[n] = 1
    integrality = np.zeros(nv)
    integrality[n + 1:] = 1
    ub = np.concatenate([[big - s for s in sizes], [big], np.ones(len(pairs))])
    res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(nv), ub), options={"time_limit": time_limit})
    if res.x is None or res.x[n] >= warm.total_bytes - 0.5:
        return _finish("ilp", list(warm.offsets), sizes, starts, ends, t0, optimal=res.status == 0)
    off = [int(round(v)) for v in res.x[:n]]
    if overlaps(off, sizes, starts, ends):  # rounding of a fractional solution: keep the heuristic
        off = list(warm.offsets)
    return _finish("ilp", off, sizes, starts, ends, t0, optimal=res.status == 0)


FUNCS = {"first-fit": first_fit, "greedy-size": greedy_size, "best": best, "ilp": ilp,
         "brute": brute}


def plan(sizes, starts, ends, planner: str = "greedy-size") -> Plan:
    if planner not in FUNCS:
        raise ValueError(f"unknown planner {planner!r}; choose one of {list(FUNCS)}")
    return FUNCS[planner](list(sizes), list(starts), list(ends))


def overlaps(offsets, sizes, starts, ends) -> list[tuple[int, int]]:
    """Pairs of co-live buffers whose byte ranges overlap (empty for a valid plan)."""
    bad = []
    for i, j in itertools.combinations(range(len(sizes)), 2):
        if starts[i] <= ends[j] and starts[j] <= ends[i] and sizes[i] and sizes[j]:
            if offsets[i] < offsets[j] + sizes[j] and offsets[j] < offsets[i] + sizes[i]:
                bad.append((i, j))
    return bad
