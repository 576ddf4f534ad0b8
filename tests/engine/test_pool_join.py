"""The paged K/V pool under a GPU budget (memory/kv_pool.py, engine/scheduler.py fits): the
engine keeps one pool on a budgeted GPU, a joining request is charged what the pool holds at
the peak of making its store (old + grown buffers during the copy), and one whose join would
pass the budget through that growth waits before anything is allocated."""

import threading
from types import SimpleNamespace

import torch
from conftest import random_model
from fake_graphs import FakeGraphs

from mosaic import MosaicEngine
from mosaic.engine.scheduler import Scheduler
from mosaic.engine.steps import kv_pool_for
from mosaic.memory.kv_pool import KVPool
from mosaic.memory.kv_store import StoreLayout
from mosaic.runtime.graphs import StepGraphs

LAYERS, KV = 2, 8
CFG = SimpleNamespace(num_layers=LAYERS, kv_dim=KV)
ROW_BYTES = 2 * LAYERS * KV * 4                     # float32 K and V of one token


def _layout(batch, length):
    return StoreLayout.of(CFG, batch, length, 4)


def test_a_budgeted_gpu_engine_gets_an_exact_pool(monkeypatch):
    """On a (simulated) CUDA device under a budget the engine's stores share one exact pool;
    no tensor is made on the device until a store is (the pool starts empty)."""
    made = []
    monkeypatch.setattr(KVPool, "__init__", lambda self, *a, **k: made.append((a, k)))
    model = SimpleNamespace(device=torch.device("cuda", 0), cfg=CFG, dtype=torch.bfloat16)
    assert isinstance(kv_pool_for(model, True), KVPool) and made[-1][1] == {"exact": True}
    assert isinstance(kv_pool_for(model, False), KVPool) and made[-1][1] == {"exact": False}


class PoolRun:
    """What the Scheduler reads of a RequestRun, whose start makes a store of `length` tokens in
    the pool and whose end gives it back."""

    def __init__(self, name, pool, length, steps=2):
        self.name, self.pool, self.steps = name, pool, steps
        self.request = SimpleNamespace(batch=1, length=length, native=False, grammar=None,
                                       gen=SimpleNamespace(max_new_tokens=8))
        self.admission = SimpleNamespace(layout=_layout(1, length))
        self.total_steps, self.steps_done, self.store, self.pending = steps, 0, None, None
        self.cancel_event = threading.Event()

    @property
    def done(self):
        return self.store is not None and self.steps_done == self.steps

    def start(self):
        self.store = self.pool.store(self.admission.layout)
        self.pending = "step"

    def advance(self, outs):
        self.steps_done += 1
        if self.done:
            self.store.close()

    def is_cancelled(self):
        return False

    def close(self):
        if self.store is not None:
            self.store.close()

    def result(self):
        return SimpleNamespace(name=self.name)


class Budgeted:
    """A fake Admitter over a budget: fixed bytes + the stacked step's store (rows x the longest
    length) + what it is told is held besides must fit; the pool's own record (every byte its
    buffers held at once) is the driver's counter of the K/V bytes."""

    def __init__(self, budget, fixed, cached=True):
        self.budget, self.fixed, self.asked, self.cached = budget, fixed, [], cached

    def layout(self, batch, n, hot=None, gen=None):
        return _layout(batch, n)

    def store_bytes(self, batch, n, gen):
        return self.layout(batch, n).device_bytes if self.cached else 0

    def fits(self, rows, n, gen, constrained=False, extra_bytes=0):
        self.asked.append(extra_bytes)
        return self.fixed + self.store_bytes(rows, n, gen) + extra_bytes <= self.budget


def _scheduler(budget, fixed=0, cached=True):
    pool = KVPool(LAYERS, KV, torch.float32, "cpu", exact=True)
    adm = Budgeted(budget, fixed, cached)
    engine = SimpleNamespace(memory=SimpleNamespace(has_budget=True), admitter=adm,
                             executor=SimpleNamespace(kv_pool=pool),
                             model=SimpleNamespace(cfg=SimpleNamespace(num_layers=LAYERS)))
    ex = SimpleNamespace(stats=None, run_round=lambda work: [("out",)] * len(work), drop=lambda run: None)
    return Scheduler(engine, executor=ex), pool, adm


def test_a_join_whose_pool_growth_would_pass_the_budget_waits_before_any_allocation():
    """Two stores of 64 tokens fit the budget side by side, but the second one's growth holds
    the first's buffers and the grown ones at once (3 x 64 rows): it waits, with nothing
    allocated, until the first has left; every instant stays inside the budget."""
    store = 64 * ROW_BYTES
    s, pool, adm = _scheduler(budget=2 * store + store // 2)
    a, b = PoolRun("a", pool, 64, steps=3), PoolRun("b", pool, 64, steps=1)
    s.add(a)
    s.add(b)
    s.step()
    assert [r.name for r in s.running] == ["a"] and [r.name for r in s.waiting] == ["b"]
    assert adm.asked[-1] == store                        # the old buffers during the copy
    assert adm.fixed + 2 * store <= adm.budget           # what the charge without the growth allowed
    assert pool.rows == 64 and b.store is None           # b allocated nothing
    while s.has_work:
        s.step()
    assert b.done and pool.storage.peak_bytes <= adm.budget


def test_when_the_stacked_steps_options_keep_no_cache_the_whole_pool_is_charged():
    """The stacked step is charged with the options of its longest canvas; where those keep no
    block cache nothing charges the stores, so the join is charged the pool's whole peak (in
    the server, a mixed batch's cached requests then failed their steps: -0.2 MiB left)."""
    s, pool, adm = _scheduler(budget=10**6, cached=False)
    s.add(PoolRun("a", pool, 64, steps=3))
    s.add(PoolRun("b", pool, 32))
    s.step()
    assert adm.asked[-1] == (64 + 64 + 32) * ROW_BYTES                   # old + grown buffers, all of it


def test_joins_that_grow_the_pool_stay_inside_the_budget_at_every_instant():
    """Runs of mixed lengths join while they fit; the most bytes the pool's buffers ever held at
    once (growth copies included) is inside what the Scheduler charged, and runs that would not
    fit wait rather than start."""
    s, pool, adm = _scheduler(budget=600 * ROW_BYTES, fixed=50 * ROW_BYTES)
    runs = [PoolRun(f"r{i}", pool, n, steps=1 + i % 3) for i, n in enumerate([100, 40, 130, 70, 90, 20, 150])]
    for r in runs:
        s.add(r)
    most = waited = 0
    while s.has_work:
        s.step()
        most = max(most, len(s.running))
        waited += bool(s.running and s.waiting)
    assert all(r.done for r in runs) and most >= 2 and waited
    assert adm.fixed + pool.storage.peak_bytes <= adm.budget
    assert not pool.live and pool.idle_bytes == pool.capacity_bytes   # every store left: the buffers stay, idle


FAST = [([3, 4, 5, 6], dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.9)),
        ([7, 8, 9, 10, 11, 12, 13], dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.9)),
        ([5, 6], dict(max_new_tokens=8, steps=8, block_length=4, cache="prefix", threshold=0.5))]


def _batched(eng, pooled: bool):
    if not pooled:
        eng.executor.kv_pool = None                       # each request a store of its own
    sched = Scheduler(eng)
    runs = [eng.start(eng.request(p, **o)) for p, o in FAST]
    sched.add(runs[0])
    for run in runs[1:]:
        sched.step()                                      # later requests join at later boundaries
        sched.add(run)
    ended = sched.run_all()
    assert all(f.error is None for f in ended)
    return [r.result().tokens for r in runs], sched


def test_under_a_budget_pooled_stores_give_the_per_store_tokens():
    """Under a budget (the exact pool a GPU budget gets) requests joining one by one stack their
    block steps over the pool and get the tokens the per-store path gives them; the pool kept
    its buffers, idle, when the last left."""
    model = random_model("llada")
    cfg = {"progress": False, "memory_budget": model.weight_bytes() + 2**30}
    eng = MosaicEngine(model, cfg)
    assert eng.executor.kv_pool.storage.exact
    got, sched = _batched(eng, True)
    want, _ = _batched(MosaicEngine(model, cfg), False)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert sched.stats.stacked_steps > 0 and not eng.executor.kv_pool.live


def test_under_a_budget_batched_block_steps_pad_to_their_bucket_once_a_join_grew_the_scratch():
    """With captured steps under a budget, a stacked block step whose scratch rows no free pages
    hold runs unpadded; the next join's growth adds them (charged with it), and from then on
    steps pad to their batch bucket. Tokens equal the run without a budget (no padding limits)."""
    model = random_model("llada")
    opts = dict(max_new_tokens=16, steps=16, block_length=4, cache="dual", threshold=1.0)
    prompts = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13], [5, 6], [9, 10, 11], [4, 4, 4, 4, 4]]

    def run(cfg):
        eng = MosaicEngine(model, {"progress": False, "varlen_kernel": "gather", **cfg})
        eng.runner.graphs = StepGraphs(FakeGraphs())
        sched, runs = Scheduler(eng), [eng.start(eng.request(p, **opts)) for p in prompts]
        for i in range(400):
            if i % 2 == 0 and i // 2 < len(runs):
                sched.add(runs[i // 2])
            assert not any(f.error for f in sched.step())
            if not sched.has_work and i // 2 >= len(runs):
                break
        return [r.result().tokens for r in runs], eng
    want, _ = run({})
    got, eng = run({"memory_budget": model.weight_bytes() + 2**30})
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    pool = eng.executor.kv_pool
    assert pool.storage.exact and pool.scratch_hint > 0 and not pool.live
    pooled = [k for k in eng.runner.graphs.graphs if k[3] and k[3][0] == "pool"]
    assert {k[1][0] for k in pooled} & {4, 8}                               # padded to buckets (3 + 1, 5 + 3)
