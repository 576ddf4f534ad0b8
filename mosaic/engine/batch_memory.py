"""What a Scheduler's running batch holds under a budget (engine/scheduler.py asks): whether a
newcomer's join fits, what the K/V pool holds beyond the stacked step's charge, and the charge
the batch's captured steps are held under.

The stacked step of a batch is charged at its worst case: every row at the longest length with
the largest canvas among its requests (policy/admitter.py plans it on meta tensors)."""

from __future__ import annotations

from ..policy.graph_charge import GraphCharge


def stacked_shape(reqs: list) -> tuple:
    """(rows, tokens, options) of the stacked step of `reqs` (engine/request.Request)."""
    gen = max((q.gen for q in reqs), key=lambda g: g.max_new_tokens)
    return sum(q.batch for q in reqs), max(q.length for q in reqs), gen


def pool_of(engine):
    """The engine's K/V pool (memory/kv_pool.py), or None."""
    return getattr(getattr(engine, "executor", None), "kv_pool", None)


def pool_extra(engine, run, rows: int, n: int, gen) -> int:
    """Bytes the engine's K/V pool holds at the peak of `run` joining (None: nobody joins) beyond
    what the stacked step's charge (a store of rows x n tokens where `gen` keeps a cache) already
    counts: the old buffers during a growth's copy, free and idle pages kept and pages rounded
    per store (memory/kv_pool.py peak_bytes). 0 without a pool."""
    pool = pool_of(engine)
    if pool is None:
        return 0
    lay = getattr(getattr(run, "admission", None), "layout", None)
    joins = lay.rows if lay is not None and lay.hot >= lay.num_layers else 0
    peak = pool.peak_bytes(joins) if joins else pool.capacity_bytes
    return max(0, peak - engine.admitter.store_bytes(rows, n, gen))


def admits(engine, run, reqs: list, rows: int) -> bool:
    """The Admitter's answer for the stacked step of `reqs` (`run` joining) with the pool's
    extra bytes; constrained steps are charged as they run, so each kind is asked."""
    _, n, gen = stacked_shape(reqs)
    extra = pool_extra(engine, run, rows, n, gen)
    held = {"extra_bytes": extra} if extra else {}
    return all(engine.admitter.fits(rows, n, gen, constrained=c, **held) for c in {q.grammar is not None for q in reqs})


def hold_graphs(engine, running: list) -> None:
    """Under a budget, a batch of several requests holds its captured steps under what its
    stacked step leaves of the budget (Admitter.batch_graphs -> engine/device_memory.py
    batch_graphs). A request's own admission charged graphs for its step alone, and a stacked
    step's static inputs hold the batch's rows: under one request's charge every stacked shape
    ran eager (H200, 16 served requests: 131 of 131 stacked steps). Eager when a request in the
    batch was admitted eager (cfg, offload, a host-tier store). A batch left with one request keeps
    the charge it had (its step is no larger), as does a request alone (its own admission's)."""
    memory = getattr(engine, "memory", None)
    hold = getattr(memory, "batch_graphs", None)      # None: an engine whose memory keeps no graphs
    if len(running) < 2 or hold is None or not memory.has_budget:
        return
    reqs = [r.request for r in running]
    if any(q.native for q in reqs):
        return
    if not all(getattr(getattr(r, "admission", None), "captured", False) for r in running):
        hold(GraphCharge(False, note="eager: a request in the batch runs eager"), None)
        return
    rows, n, gen = stacked_shape(reqs)
    constrained = any(q.grammar is not None for q in reqs)
    extra = pool_extra(engine, None, rows, n, gen)
    hold(*engine.admitter.batch_graphs(rows, n, gen, constrained, extra))
