"""Idle K/V pool buffers under a budget (memory/kv_pool.py): when the last store leaves the buffers
stay, so the next request of the same shape gets the same rows at the same address and replays its
captured steps instead of capturing them again; their bytes are held device memory, counted by
whatever admits work, and given back (trimmed) wherever work would otherwise wait or not fit."""

from types import SimpleNamespace

import torch
from conftest import random_model
from fake_graphs import FakeGraphs
from test_pool_join import CFG, KV, LAYERS, ROW_BYTES, Budgeted, PoolRun, _layout

from mosaic import MosaicEngine
from mosaic.engine import device_memory as dm
from mosaic.engine.run import idle_pool_beyond
from mosaic.engine.scheduler import Scheduler
from mosaic.engine.warmup import warm_up
from mosaic.memory.kv_pool import KVPool
from mosaic.memory.kv_store import StoreLayout
from mosaic.memory.transient import DeviceGuard, SimBackend
from mosaic.runtime.graphs import StepGraphs

MiB = 2**20
DUAL = dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.9)


def _idle_pool(rows=64):
    """An exact pool whose one store of `rows` tokens has left: its buffers idle."""
    pool = KVPool(LAYERS, KV, torch.float32, "cpu", exact=True)
    pool.store(_layout(1, rows)).close()
    assert pool.idle_bytes == rows * ROW_BYTES
    return pool


class StorelessRun(PoolRun):
    """A run that keeps no store in the pool (the exact sampler, a host-tier store)."""

    def __init__(self, name, pool, length, steps=2):
        super().__init__(name, pool, length, steps)
        self.admission = SimpleNamespace(layout=None)
        self.started = False

    @property
    def done(self):
        return self.started and self.steps_done == self.steps

    def start(self):
        self.started, self.pending = True, "step"

    def advance(self, outs):
        self.steps_done += 1

    def close(self):
        pass


def _scheduler(pool, budget, fixed=0):
    adm = Budgeted(budget, fixed, cached=False)         # nothing charges the stores: the pool whole
    engine = SimpleNamespace(memory=SimpleNamespace(has_budget=True), admitter=adm,
                             executor=SimpleNamespace(kv_pool=pool),
                             model=SimpleNamespace(cfg=SimpleNamespace(num_layers=LAYERS)))
    ex = SimpleNamespace(stats=None, run_round=lambda work: [("out",)] * len(work), drop=lambda run: None)
    return Scheduler(engine, executor=ex), adm


def test_a_join_is_charged_the_idle_buffers_and_keeps_them_where_they_fit():
    pool = _idle_pool(64)
    s, adm = _scheduler(pool, budget=10**6)
    s.add(StorelessRun("a", pool, 16, steps=3))
    s.add(StorelessRun("b", pool, 16))
    s.step()
    assert [r.name for r in s.running] == ["a", "b"]
    assert adm.asked[-1] == 64 * ROW_BYTES                                 # the idle bytes, held
    assert pool.rows == 64                                                 # room for them: kept


def test_a_join_that_needs_the_idle_bytes_gets_them_instead_of_waiting():
    """Idle buffers (no store alive) that make a join not fit are given back and the join asked
    again, in the same round: it never waits for idle capacity."""
    for joiner in (StorelessRun, PoolRun):
        pool = _idle_pool(64)
        s, adm = _scheduler(pool, budget=32 * ROW_BYTES)
        s.add(StorelessRun("a", pool, 16, steps=3))
        s.add(joiner("b", pool, 16))
        s.step()
        assert [r.name for r in s.running] == ["a", "b"] and not s.waiting
        assert adm.asked[-2] == 64 * ROW_BYTES and adm.asked[-1] <= 16 * ROW_BYTES   # refused, trimmed, admitted
        assert pool.rows == (16 if joiner is PoolRun else 0)              # the new store alone, no copy
        while s.has_work:
            s.step()
        assert pool.storage.peak_bytes <= 64 * ROW_BYTES


def test_a_join_next_to_a_live_store_never_trims():
    pool = KVPool(LAYERS, KV, torch.float32, "cpu", exact=True)
    s, _ = _scheduler(pool, budget=70 * ROW_BYTES)
    s.add(PoolRun("a", pool, 64, steps=3))
    s.add(PoolRun("b", pool, 64))
    s.step()
    assert [r.name for r in s.waiting] == ["b"] and pool.rows == 64     # waits: a's store is alive


def _admission(layout, room, budget=10**9):
    return SimpleNamespace(layout=layout, budget_bytes=budget, predicted_bytes=budget - room)


def test_a_starting_request_keeps_idle_buffers_only_where_its_admission_has_room():
    """engine/run.py at a request's start: the bytes held beyond its own store must fit what its
    admission left of the budget, else the idle buffers go before anything of it exists; a
    request that keeps no store here (no cache, host tier) is charged them whole, one with
    nothing planned (native) has no room for them."""
    host = StoreLayout.of(CFG, 1, 16, 4, 0)                              # no layer on the device
    cases = [(_admission(_layout(1, 64), 0), 0, 64),                     # the same shape: no extra bytes
             (_admission(_layout(1, 32), 32 * ROW_BYTES), 32 * ROW_BYTES, 64),
             (_admission(_layout(1, 32), 32 * ROW_BYTES - 1), 0, 0),     # one byte short: trimmed
             (_admission(None, 64 * ROW_BYTES), 64 * ROW_BYTES, 64),     # no store: the whole buffers
             (_admission(None, 64 * ROW_BYTES - 1), 0, 0),
             (_admission(host, 64 * ROW_BYTES - 1), 0, 0),               # a host-tier store is elsewhere
             (_admission(_layout(1, 80), 10**9), 0, 0),                  # larger: trimmed, made new
             (None, 0, 0)]                                               # native: no room known
    for adm, beyond, rows in cases:
        pool = _idle_pool(64)
        assert idle_pool_beyond(pool, adm) == beyond
        assert pool.rows == rows
    assert idle_pool_beyond(None, cases[0][0]) == 0


def test_bytes_kept_for_a_request_come_off_its_graph_pools_slack():
    eng = MosaicEngine(random_model("llada"), {"progress": False, "memory_budget": "1GiB"})
    eng.memory.use_guard(DeviceGuard(SimBackend(), eng.budget.budget_bytes, outside_bytes=0))
    graphs = StepGraphs(FakeGraphs())
    graphs.bytes_per_op = 1024
    eng.use_graphs(graphs)
    adm = eng.admit(1, 11, eng.generation_config(**DUAL))
    assert adm.captured
    eng.memory.begin(adm)
    base = eng.memory._slack_base
    eng.memory.end()
    eng.memory.begin(adm, held=5 * MiB)
    assert eng.memory._slack_base == base - 5 * MiB
    eng.memory.end()


def _graph_engine(model, guard: bool):
    eng = MosaicEngine(model, {"progress": False, "memory_budget": "1GiB"})
    if guard:
        eng.memory.use_guard(DeviceGuard(SimBackend(), eng.budget.budget_bytes, outside_bytes=0))
        # a GPU's arena (memory/vmm.py) never moves its base; the CPU's host arena is reallocated
        # per plan under a guard, which alone would change every step's graph key
        eng.memory.arena.exact, eng.memory.arena.trim = False, lambda nbytes: None
    graphs = StepGraphs(FakeGraphs(driver_bytes=MiB))
    graphs.bytes_per_op = 1024
    eng.use_graphs(graphs)
    return eng, graphs


def test_sequential_requests_of_one_shape_under_a_budget_capture_once():
    """The second request's store is at the first's rows and address: its steps replay the
    first's graphs (before, the pool's buffers went back and every request captured again)."""
    model = random_model("llada")
    ref = MosaicEngine(model, {"progress": False}).generate([3, 4, 5], **DUAL)
    eng, graphs = _graph_engine(model, guard=False)
    first = eng.generate([3, 4, 5], **DUAL)
    where = eng.executor.kv_pool.address()
    second = eng.generate([3, 4, 5], **DUAL)
    assert torch.equal(first.tokens, ref.tokens) and torch.equal(second.tokens, ref.tokens)
    assert first.stats["graphs"]["captures"] > 0
    assert second.stats["graphs"]["captures"] == 0 and second.stats["graphs"]["replays"] > 0
    assert eng.executor.kv_pool.address() == where and graphs.stats.captures == first.stats["graphs"]["captures"]


def test_under_the_guard_requests_of_one_shape_stop_capturing():
    """With the guard's graph mode (its kept pool, the graphs' charge): once every shape has been
    captured the requests only replay, inside the guard's cap (the simulated allocator)."""
    model = random_model("llada")
    eng, graphs = _graph_engine(model, guard=True)
    outs = [eng.generate([3, 4, 5], **DUAL) for _ in range(3)]
    assert outs[-1].stats["graphs"]["captures"] == 0 and outs[-1].stats["graphs"]["replays"] > 0
    assert all(torch.equal(o.tokens, outs[0].tokens) for o in outs)
    assert eng.executor.kv_pool.idle_bytes > 0 and eng.guard.backend.limit is None


def test_close_and_a_step_outside_any_request_give_the_idle_buffers_back():
    eng = MosaicEngine(random_model("llada"), {"progress": False, "memory_budget": "1GiB"})
    pool = eng.executor.kv_pool
    for release in (lambda: eng.step(torch.tensor([[3, 4, eng.model.cfg.mask_id]])), eng.close):
        eng.generate([3, 4, 5], **DUAL)
        assert pool.idle_bytes > 0
        release()                                        # engine.step: charged no pool
        assert pool.rows == 0 and pool.capacity_bytes == 0


class Counters:
    """The warm-up's device counters, flat (what it measures is not the point here)."""

    def used(self):
        return 0

    reserved = used

    def settle(self):
        pass

    def touch(self, dtype):
        pass


def test_the_warm_up_gives_its_idle_buffers_back_before_it_measures():
    eng = MosaicEngine(random_model("llada"), {"progress": False, "memory_budget": "1GiB"})
    pool, held = eng.executor.kv_pool, []

    def run_request(prompt, gen_len, opts):
        eng.warm_request(prompt, gen_len, {**opts, "cache": "dual"})
        held.append(pool.idle_bytes)
    warm_up(eng.memory, run_request, eng.sampler, length=64, counters=Counters())
    assert held and held[0] > 0                                           # kept between its requests
    assert pool.rows == 0                                                 # not measured as workspace


def test_a_new_engine_counts_another_engines_idle_buffers(monkeypatch):
    cuda = torch.device("cuda", 0)
    mine, other = (SimpleNamespace(device=cuda, name=n) for n in ("mine", "other"))
    monkeypatch.setattr(dm.warmup, "resident_weight_bytes", lambda m: 0)
    live = SimpleNamespace(model=other, device=cuda, closed=False, arena=SimpleNamespace(kind="vmm"),
                           kv_pool=SimpleNamespace(capacity_bytes=7 * MiB))
    monkeypatch.setattr(dm, "_LIVE", [live])
    assert dm._others_bytes(mine) == 7 * MiB
