"""The caching allocator's rules, the transient pool and the budget's backstop, on a simulated
allocator (CPU): sizes, segments, and that a guarded step never exceeds its budget."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mosaic.errors import MemoryBudgetError
from mosaic.memory.caching import (
    LARGE_BUFFER,
    MiB,
    SimAllocator,
    SimOOM,
    pool_bytes,
    round_size,
    segment_bytes,
)
from mosaic.memory.transient import SMALL_POOL_BYTES, DeviceGuard, SimBackend


def test_rounding_rules():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert segment_bytes(100) == 2 * MiB and segment_bytes(MiB) == 2 * MiB
    assert segment_bytes(MiB + 1) == LARGE_BUFFER and segment_bytes(10 * MiB - 512) == LARGE_BUFFER
    assert segment_bytes(10 * MiB) == 10 * MiB and segment_bytes(11 * MiB + 1) == 12 * MiB
    assert pool_bytes(0) == 0 and pool_bytes(1) == 10 * MiB
    assert pool_bytes(128 * MiB) == 130 * MiB          # 64 KiB of rounding slack needs a page
    assert pool_bytes(128 * MiB - 64 * 1024) == 128 * MiB


def test_small_requests_share_a_2_mib_segment():
    a = SimAllocator()
    a.malloc(MiB)
    a.malloc(MiB)
    assert a.reserved == 2 * MiB and a.segments_created == 1
    a.malloc(1)
    assert a.reserved == 4 * MiB


def test_a_1_to_10_mib_request_opens_a_20_mib_segment_that_later_requests_split():
    a = SimAllocator()
    a.malloc(int(1.4 * MiB))          # the first soak's canvas: 180,224 int64 tokens
    a.malloc(5 * MiB)
    a.malloc(8 * MiB)
    assert a.reserved == LARGE_BUFFER and a.segments_created == 1
    a.malloc(6 * MiB)                 # 5.6 MiB left: a new segment
    assert a.reserved == 2 * LARGE_BUFFER


def test_best_fit_split_threshold_merge_and_empty_cache():
    a = SimAllocator()
    big = a.malloc(100 * MiB)
    mid = a.malloc(30 * MiB)
    a.free(big)
    a.free(mid)
    x = a.malloc(int(29.5 * MiB))     # best fit: the 30 MiB block, 0.5 MiB left is not split
    assert a.blocks[x].size == 30 * MiB and a.reserved == 130 * MiB
    y = a.malloc(40 * MiB)            # split from the 100 MiB block
    a.free(y)                         # merges back
    assert a.largest_free() == 100 * MiB
    a.empty_cache()                   # the free 100 MiB segment goes; the used 30 MiB stays
    assert a.reserved == 30 * MiB


def test_the_fraction_frees_the_cache_then_refuses():
    a = SimAllocator(limit=100 * MiB)
    a.free(a.malloc(60 * MiB))
    a.malloc(80 * MiB)                # over the limit with the cached 60: it is released first
    assert a.reserved == 80 * MiB
    with pytest.raises(SimOOM):
        a.malloc(30 * MiB)


def _op(backend, sizes):
    """One op's transients: allocated in turn, all freed at its end."""
    handles = [backend.malloc(s) for s in sizes]
    for h in handles:
        backend.free(h)


transients = st.lists(st.integers(1, 64 * MiB), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(transients, min_size=1, max_size=8), request=st.lists(st.integers(1, 12 * MiB), max_size=8),
       strategy=st.sampled_from(["mempool", "shared"]))
def test_ops_run_from_the_pool_without_a_new_segment(ops, request, strategy):
    """However the request's tensors sit in the default pool, a step whose ops each allocate at
    most E outside the plan takes no segment beyond the reserved pool, under a cap that leaves
    PyTorch exactly what it holds + the pool."""
    E = max(sum(o) for o in ops)
    b = SimBackend(strategy)
    live = [b.malloc(s) for s in request]           # canvas, masks, rows: before the step
    held = b.reserved()
    g = DeviceGuard(b, budget_bytes=held + pool_bytes(E) + SMALL_POOL_BYTES + 500 * MiB,
                    outside_bytes=0)
    g.before_step(E, arena_bytes=500 * MiB)
    created = b.default.segments_created + (b.pool.segments_created if b.pool else 0)
    with g.scope():
        for sizes in ops:
            _op(b, sizes)
        assert b.default.segments_created + (b.pool.segments_created if b.pool else 0) == created
    assert b.reserved() <= g.limit_bytes
    for h in live:
        b.free(h)


def test_small_transients_fit_the_two_small_segments():
    b = SimBackend()
    g = DeviceGuard(b, budget_bytes=10**12, outside_bytes=0)
    g.before_step(64 * MiB, 0)
    n = b.pool.segments_created
    with g.scope():
        _op(b, [700 * 1024, 700 * 1024, 600 * 1024, 64 * MiB - 3 * MiB])   # 2 MiB of small ones
    assert b.pool.segments_created == n


def test_a_request_stream_stays_under_the_budget(seed=0):
    """Requests of random sizes back to back: weights and request tensors in the default pool,
    a new pool whenever the charge changes, arena pages outside; the device total (PyTorch's
    reserved + the arena + the driver's share) never passes the budget and nothing OOMs."""
    rng = random.Random(seed)
    b = SimBackend()
    weights = b.malloc(3000 * MiB)
    outside = 700 * MiB
    budget = 3000 * MiB + outside + 2000 * MiB
    g = DeviceGuard(b, budget, outside)
    worst = 0
    for _ in range(40):
        E = rng.choice([0, 3 * MiB, 40 * MiB, 130 * MiB, 300 * MiB])
        req = [rng.randint(1, 8 * MiB) for _ in range(rng.randint(1, 6))]
        charge_req = sum(req) + 32 * MiB                        # REQUEST_SLACK_BYTES
        arena = budget - outside - 3000 * MiB - charge_req - (pool_bytes(E) + SMALL_POOL_BYTES if E else 0)
        arena = max(0, arena - 64 * MiB) // (2 * MiB) * (2 * MiB)
        live = [b.malloc(s) for s in req]
        for _step in range(3):
            g.before_step(E, arena)
            with g.scope():
                for _op_i in range(5):
                    _op(b, [rng.randint(1, max(1, E // 3)) for _ in range(3)] if E else [])
                    worst = max(worst, b.reserved() + arena + outside)
            outs = b.malloc(rng.randint(1, 2 * MiB))           # the step's outputs, cloned
            worst = max(worst, b.reserved() + arena + outside)
            b.free(outs)
        for h in live:
            b.free(h)
        g.end()
        assert b.limit is None
    assert worst <= budget
    b.free(weights)


def test_live_tensors_over_the_cap_are_named_not_hidden():
    b = SimBackend()
    b.malloc(900 * MiB)
    g = DeviceGuard(b, budget_bytes=1000 * MiB, outside_bytes=200 * MiB)
    with pytest.raises(MemoryBudgetError, match="accounting missed"):
        g.before_step(10 * MiB, arena_bytes=0)


def test_cached_blocks_are_handed_back_before_the_arena_grows():
    b = SimBackend()
    x = b.malloc(600 * MiB)
    b.free(x)                                        # an earlier step's cached segment
    g = DeviceGuard(b, budget_bytes=1000 * MiB, outside_bytes=100 * MiB)
    g.before_step(20 * MiB, arena_bytes=800 * MiB)   # PyTorch may hold 100 MiB now
    assert b.default.reserved == 0 and b.reserved() <= 100 * MiB


def test_the_pool_is_rebuilt_when_the_charge_changes_and_kept_when_not():
    b = SimBackend()
    g = DeviceGuard(b, budget_bytes=10**12, outside_bytes=0)
    g.before_step(100 * MiB, 0)
    first = b.pool
    g.before_step(100 * MiB, 0)
    assert b.pool is first and first.segments_created == 3        # 1 large + 2 small
    g.before_step(20 * MiB, 0)
    assert b.pool is not first and b.reserved() == pool_bytes(20 * MiB) + SMALL_POOL_BYTES
    g.before_step(0, 0)                              # nothing outside the plan: no pool
    assert b.pool is None and b.reserved() == 0


def test_shared_strategy_hands_the_segment_back_after_the_ops():
    b = SimBackend("shared")
    g = DeviceGuard(b, budget_bytes=10**12, outside_bytes=0)
    g.before_step(100 * MiB, 0)
    assert b.default.largest_free() >= 100 * MiB
    with g.scope():
        _op(b, [60 * MiB, 40 * MiB])
    assert b.reserved() == 0                         # request tensors cannot settle in it
