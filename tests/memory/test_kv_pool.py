"""The paged K/V pool (memory/kv_pool.py): what a store is charged is what the pool allocates,
pages come back when a request leaves, mixed lengths take their own pages (no padding to the
longest), holes are reused and compacted away before the buffers grow, and a store's rows keep
their values through growth and compaction."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mosaic.memory.kv_pool import KVPool
from mosaic.memory.kv_store import PAGE_TOKENS, StoreLayout

LAYERS, KV = 2, 8


class Cfg:
    num_layers, kv_dim = LAYERS, KV


def _layout(batch, length):
    return StoreLayout.of(Cfg, batch, length, 4)


def _pool(**kw):
    return KVPool(LAYERS, KV, torch.float32, "cpu", **kw)


def _fill(store, value):
    for i in range(LAYERS):
        K, V = store.acquire(i)
        K.fill_(value + i)
        V.fill_(-value - i)


def _holds(store, value) -> bool:
    return all(bool((store.acquire(i)[0] == value + i).all()) and bool((store.acquire(i)[1] == -value - i).all())
               for i in range(LAYERS))


def test_a_store_is_charged_exactly_the_pages_it_is_given():
    pool = _pool()
    for batch, length in [(1, 37), (3, 100), (2, 16), (1, 1)]:
        lay = _layout(batch, length)
        store = pool.store(lay)
        assert store.extent.pages * pool.page_bytes == lay.device_bytes       # admission's charge
        assert lay.rows == -(-batch * length // PAGE_TOKENS) * PAGE_TOKENS
        K, V = store.acquire(0)
        assert K.shape == (batch, length, KV) and V.shape == (batch, length, KV)
    assert pool.allocated_bytes == sum(_layout(b, n).device_bytes for b, n in [(1, 37), (3, 100), (2, 16), (1, 1)])


def test_mixed_lengths_take_their_own_pages_not_the_longest():
    pool = _pool()
    lengths = [1030, 1100, 1570, 1200]
    for n in lengths:
        pool.store(_layout(1, n))
    used = pool.allocated_pages * PAGE_TOKENS
    assert used == sum(-(-n // PAGE_TOKENS) * PAGE_TOKENS for n in lengths) < len(lengths) * max(lengths)
    assert used - sum(lengths) < len(lengths) * PAGE_TOKENS                  # under a page each


def test_pages_come_back_when_a_request_leaves_and_holes_are_reused():
    pool = _pool()
    a, b, c = (pool.store(_layout(1, 64)) for _ in range(3))
    before = pool.allocated_pages
    b.close()
    b.close()                                                               # once only
    assert pool.allocated_pages == before - 4
    d = pool.store(_layout(1, 50))                                          # fits b's hole: first fit
    assert d.first_row == 64 and pool.rows >= 192
    for s in (a, c, d):
        s.close()
    assert pool.allocated_pages == 0


def test_fragmented_holes_are_compacted_before_the_buffers_grow():
    pool = _pool(exact=True)
    stores = [pool.store(_layout(1, 32)) for _ in range(4)]                 # 2 pages each, 128 rows
    for i, s in enumerate(stores):
        _fill(s, 10 * i)
    stores[0].close()
    stores[2].close()                                                       # two holes of 2 pages
    big = pool.store(_layout(1, 64))                                        # needs 4: compact, no growth
    assert pool.compactions == 1 and pool.rows == 128
    assert _holds(stores[1], 10) and _holds(stores[3], 30)                  # moved with their values
    assert big.first_row == 64


def test_under_a_budget_the_buffers_grow_exactly_never_shrink_by_a_copy_and_stay_idle_when_empty():
    pool = _pool(exact=True)
    a, b = pool.store(_layout(1, 64)), pool.store(_layout(1, 64))
    assert pool.rows == 128 and pool.capacity_bytes == pool.allocated_bytes
    moves = pool.storage.moves
    b.close()
    assert pool.rows == 128 and pool.storage.moves == moves                 # freed pages stay: no copy
    c = pool.store(_layout(1, 50))                                          # reused, no growth
    assert c.first_row == 64 and pool.storage.moves == moves
    assert pool.idle_bytes == 0 and pool.held_bytes == pool.capacity_bytes
    a.close()
    c.close()
    assert pool.rows == 128 and not pool.live                               # the last store left: kept, idle
    assert pool.idle_bytes == pool.held_bytes == pool.capacity_bytes == 128 * pool.storage.row_bytes()
    assert pool.trim() == 128 * pool.storage.row_bytes()                    # given back when asked
    assert pool.rows == 0 and pool.capacity_bytes == 0 and pool.trim() == 0


def test_under_a_budget_sequential_stores_of_one_shape_keep_their_rows_and_address():
    """The next request's store of the same (or a smaller) size takes the idle buffers: the same
    first row and pool address (a captured step keyed by them replays), no allocation."""
    pool = _pool(exact=True)
    a = pool.store(_layout(1, 64))
    where, moves = a.address(), pool.storage.moves
    a.close()
    assert pool.peak_bytes(_layout(1, 64).rows) == pool.capacity_bytes      # a join charged the idle bytes
    b = pool.store(_layout(1, 64))
    assert b.address() == where and pool.storage.moves == moves
    b.close()
    c = pool.store(_layout(1, 40))                                          # smaller: the same rows too
    assert c.address() == where and pool.storage.moves == moves


def test_a_store_too_large_for_idle_buffers_is_made_after_a_trim_not_by_a_copy():
    pool = _pool(exact=True)
    pool.store(_layout(1, 64)).close()
    predicted, measured, big = _measured_peak(pool, _layout(2, 64))
    assert predicted == measured == 128 * pool.storage.row_bytes()          # the new buffers alone
    assert big.first_row == 0 and pool.rows == 128


def test_reuse_or_trim_keeps_idle_buffers_only_where_the_request_has_room_for_them():
    row = _pool().storage.row_bytes()
    for rows, room, kept, beyond in [(64, 0, True, 0), (32, 32 * row, True, 32 * row), (32, 32 * row - 1, False, 0),
                                     (0, 64 * row, True, 64 * row), (80, 10**9, False, 0), (32, None, False, 0)]:
        pool = _pool(exact=True)
        pool.store(_layout(1, 64)).close()
        assert pool.reuse_or_trim(rows, room) == beyond
        assert (pool.rows == 64) == kept
    pool = _pool(exact=True)
    live = pool.store(_layout(1, 64))
    assert pool.reuse_or_trim(16, None) == 0 and pool.rows == 64 and live.first_row == 0   # a store alive: kept
    assert pool.trim() == 0
    unbudgeted = _pool()
    unbudgeted.store(_layout(1, 64)).close()
    assert unbudgeted.idle_bytes == 0 and unbudgeted.reuse_or_trim(16, None) == 0 and unbudgeted.rows == 64


def _measured_peak(pool, layout):
    """(predicted peak_bytes, the most bytes the buffers held at once while the store was made)."""
    predicted = pool.peak_bytes(layout.rows)
    pool.storage.peak_bytes = pool.capacity_bytes
    store = pool.store(layout)
    return predicted, max(pool.storage.peak_bytes, pool.capacity_bytes), store


def test_peak_bytes_covers_what_growth_and_compaction_hold_at_once():
    """What a join is charged (peak_bytes, asked before anything is allocated) is at least what
    the buffers held at once while the store was made: old + new during a growth's copy, the
    buffers alone during a compaction, and exactly so (no slack hidden in the prediction)."""
    pool = _pool(exact=True)
    held = []
    for n in (64, 32, 64, 32):
        predicted, measured, s = _measured_peak(pool, _layout(1, n))
        assert predicted == measured                                        # growth from old to old + store
        held.append(s)
    assert pool.storage.moves == 4
    held[0].close()
    held[2].close()                                                         # holes of 4 pages each
    predicted, measured, big = _measured_peak(pool, _layout(1, 112))        # 7 pages: compaction, no growth
    assert pool.compactions == 1 and predicted == measured == pool.capacity_bytes
    cap = pool.capacity_bytes
    predicted, measured, _ = _measured_peak(pool, _layout(2, 64))           # 1 free page: compact, then grow
    assert measured == cap + pool.capacity_bytes == predicted
    assert pool.capacity_bytes == pool.allocated_bytes                      # no hole carried into the new buffers


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 90)), min_size=1, max_size=30))
def test_under_a_budget_no_sequence_of_joins_holds_more_than_predicted(ops):
    """Joins, leaves and steps asking for scratch rows in any order: no join holds more than
    peak_bytes said beforehand, a scratch request never grows the buffers, stores keep their rows."""
    pool, live = _pool(exact=True), []
    for i, (leave, length) in enumerate(ops):
        if leave and live:
            live.pop(length % len(live))[0].close()
        elif length % 5 == 0:
            moves = pool.storage.moves
            pool.scratch_rows(length // 2 + 1)
            assert pool.storage.moves == moves
        else:
            predicted, measured, s = _measured_peak(pool, _layout(1 + length % 2, length))
            assert measured <= predicted
            assert pool.capacity_bytes <= max(predicted, pool.allocated_bytes)
            _fill(s, i)
            live.append((s, i))
        assert all(_holds(s, t) for s, t in live)


def test_under_a_budget_the_scratch_never_grows_the_buffers_and_rides_on_the_next_growth():
    pool = _pool(exact=True)
    a = pool.store(_layout(1, 64))
    moves = pool.storage.moves
    assert pool.scratch_rows(32) is None and pool.storage.moves == moves    # only growth would hold it
    predicted, measured, b = _measured_peak(pool, _layout(1, 64))           # grows for b and the scratch
    assert predicted == measured == (4 + 4 + 4 + 2) * pool.page_bytes
    assert pool.storage.moves == moves + 1 and pool.scratch.pages == 2
    first = pool.scratch_rows(32)
    assert first is not None and pool.storage.moves == moves + 1            # no growth of its own
    K, _ = pool.layer(0)
    assert bool((K[first:first + 32] == 0).all())
    a.close()
    b.close()
    assert pool.scratch is not None and pool.idle_bytes == pool.capacity_bytes   # kept with the idle buffers
    pool.trim()
    assert pool.scratch is None and pool.rows == 0                          # given back with the buffers


def test_scratch_rows_are_zeros_and_stay_out_of_the_stores():
    pool = _pool()
    s = pool.store(_layout(1, 40))
    _fill(s, 5)
    first = pool.scratch_rows(32)
    K, _ = pool.layer(0)
    assert bool((K[first:first + 32] == 0).all()) and _holds(s, 5)
    assert pool.scratch_rows(16) == first                                   # reused while large enough


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 90)), min_size=1, max_size=30), st.booleans())
def test_any_sequence_of_requests_keeps_every_store_whole(ops, exact):
    pool, live, tag = _pool(exact=exact), [], 0
    for leave, length in ops:
        if leave and live:
            live.pop(length % len(live))[0].close()
        else:
            tag += 1
            s = pool.store(_layout(1 + length % 2, length))
            _fill(s, tag)
            live.append((s, tag))
        spans = sorted((s.first_row, s.first_row + s.layout.rows) for s, _ in live)
        assert all(e <= b for (_, e), (b, _) in zip(spans, spans[1:]))      # no two stores overlap
        assert pool.rows >= max((e for _, e in spans), default=0)
        assert all(_holds(s, t) for s, t in live)                           # through growth and compaction
        assert pool.allocated_pages * PAGE_TOKENS == sum(s.layout.rows for s, _ in live)
