"""Captured steps under a budget (memory/transient.py graph mode, runtime/graphs.py), on the
simulated device of test_request_start.py: PyTorch's allocator (SimBackend), the real VmmArena on
a fake driver, and the driver's counter = PyTorch's reserved + the arena's pages + what the
driver holds, graphs' executables included (tests/fake_graphs.py). Requests follow the engine's
protocol (device_memory: guard_begin with the request's slack, guard_step before each step, the
arena's growth, then the step on the graphs' stream: a replay, a capture into the guard's pool,
or the eager ops in scope), and the counter must never pass the budget."""

import dataclasses
import random
import types

import torch
from conftest import random_model
from fake_graphs import FakeGraphs
from test_request_start import GRAN, Device

from mosaic import MosaicEngine
from mosaic.engine import device_memory as engine_mod
from mosaic.memory.accounting import arena_bytes
from mosaic.memory.caching import pool_bytes
from mosaic.memory.transient import SMALL_POOL_BYTES, DeviceGuard, SimBackend
from mosaic.memory.vmm import MiB
from mosaic.runtime.graphs import StepGraphs

OPS = 10      # ops of every fake step (an executable's bytes are estimated per op)


@dataclasses.dataclass(frozen=True)
class _Step:
    ids: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    reducer: object = None
    cache: object = None

    @property
    def num_masked(self):
        return self.rows.shape[0]

    def with_(self, **kw):
        return dataclasses.replace(self, **kw)


def _prepared(plan, ext, shape):
    tpl = types.SimpleNamespace(num_ops=OPS, loops={}, loop_counts={})
    return types.SimpleNamespace(plan_bytes=plan, external_bytes=ext, need_bytes=plan + ext, key=(plan, ext, shape),
                                 step=types.SimpleNamespace(num_masked=4), template=tpl, fused=False,
                                 chunks=types.SimpleNamespace(logits=1))


def _step(shape):
    ids = torch.zeros(1, 8 + shape, dtype=torch.long)
    return _Step(ids, ids.clone(), torch.arange(4))


def charge_of(plan, ext):
    """The rounded footprint of a step as admission charges it (plan pages + pool)."""
    return arena_bytes(plan) + (pool_bytes(ext) + SMALL_POOL_BYTES if ext else SMALL_POOL_BYTES)


def run_request(dev, guard, graphs, input_bytes, steps, graph_bytes, act_limit):
    """One request in graph mode: act_limit is what its steps may use in all (admission's
    activation limit less its graphs' charge)."""
    guard.use_graphs(True, graph_bytes)
    graphs.set_limits(graph_bytes, None)
    plan0, ext0, shape0 = steps[0]
    engine_mod.guard_begin(guard, dev.arena, _prepared(plan0, ext0, shape0), act_limit - charge_of(plan0, ext0))
    canvas = dev.backend.malloc(input_bytes)
    for plan, ext, shape in steps:
        p = _prepared(plan, ext, shape)
        engine_mod.guard_step(guard, dev.arena, p, max(0, act_limit - charge_of(plan, ext)))
        dev.arena.ensure(plan)
        dev.sample()
        with guard.stream():
            if graphs.run(_step(shape), p, lambda st: {}, 0) is None:    # eager
                with guard.scope():
                    if ext:
                        dev.backend.free(dev.backend.malloc(ext))
    dev.backend.free(canvas)
    guard.end()


def _setup(budget, outside, weights, driver_bytes):
    dev = Device(outside)
    w = dev.backend.malloc(weights)
    guard = DeviceGuard(dev.backend, budget, outside)
    backend = FakeGraphs(driver_bytes=driver_bytes, device=dev)
    graphs = StepGraphs(backend, pool=guard.graph_pool)
    graphs.bytes_per_op = driver_bytes / OPS
    guard.host_graphs(graphs.drop_graphs)
    return dev, w, guard, graphs, backend


def test_captures_come_from_the_guards_pool_and_replays_take_nothing():
    outside, weights, budget = 500 * MiB, 2000 * MiB, 4000 * MiB
    dev, w, guard, graphs, backend = _setup(budget, outside, weights, driver_bytes=8 * MiB)
    backend.transient_bytes = 300 * MiB
    steps = [(600 * MiB, 300 * MiB, 0)] + [(200 * MiB, 300 * MiB, 1)] * 6
    room = budget - weights - outside - 20 * MiB - 40 * MiB
    for _ in range(2):
        run_request(dev, guard, graphs, 40 * MiB, steps, 64 * MiB, room - 64 * MiB)
    assert graphs.stats.captures == 2 and graphs.stats.replays == 5 + 7   # shape 1 captured in request 1, shape 0 in 2
    assert all(p is not None and p[0] is guard._pool for p in backend.pools)   # the guard's pool, never their own
    pool = dev.backend.pool                                # one segment for every capture and eager step
    assert guard.pool_size == pool_bytes(300 * MiB) + SMALL_POOL_BYTES == pool.reserved and pool.segments_created == 3
    assert dev.peak <= budget


def test_a_kept_pool_larger_than_a_request_allows_is_rebuilt_and_its_graphs_dropped_first():
    outside, weights, budget = 500 * MiB, 2000 * MiB, 6000 * MiB
    dev, w, guard, graphs, backend = _setup(budget, outside, weights, driver_bytes=8 * MiB)
    big = [(100 * MiB, 2000 * MiB, 0)] * 3
    room = budget - weights - outside - 20 * MiB - 40 * MiB - 64 * MiB
    run_request(dev, guard, graphs, 40 * MiB, big, 64 * MiB, room)
    assert graphs.stats.captures == 1 and len(graphs.graphs) == 1
    large_plan = [(room - charge_of(0, 100 * MiB) - 8 * MiB, 100 * MiB, 2)] * 3   # no room for the old pool
    run_request(dev, guard, graphs, 40 * MiB, large_plan, 64 * MiB, room)
    assert guard.pool_size == pool_bytes(100 * MiB) + SMALL_POOL_BYTES
    assert all(k[0][2] == 2 for k in graphs.graphs)                    # the first request's graph is gone
    assert dev.peak <= budget, f"over the budget by {(dev.peak - budget) / MiB:.0f} MiB"


def test_graphs_over_their_charge_are_dropped_before_a_new_capture():
    outside, weights, budget = 500 * MiB, 2000 * MiB, 5000 * MiB
    dev, w, guard, graphs, backend = _setup(budget, outside, weights, driver_bytes=10 * MiB)
    steps = [(100 * MiB, 50 * MiB, s) for s in range(6) for _ in range(3)]    # six shapes, each captured
    room = budget - weights - outside - 20 * MiB - 40 * MiB
    run_request(dev, guard, graphs, 40 * MiB, steps, 30 * MiB, room - 30 * MiB)
    assert graphs.stats.captures == 6 and graphs.stats.evicted >= 4 and backend.held <= 30 * MiB
    assert dev.peak <= budget


def test_random_request_streams_with_graphs_never_pass_the_budget():
    rng = random.Random(7)
    outside, weights, budget = 700 * MiB, 3000 * MiB, 9000 * MiB
    dev, w, guard, graphs, backend = _setup(budget, outside, weights, driver_bytes=12 * MiB)
    for _ in range(40):
        inp = rng.choice([1 * MiB, 6 * MiB, 40 * MiB, 300 * MiB])
        ext = rng.choice([0, 3 * MiB, 40 * MiB, 900 * MiB])
        graph_bytes = rng.choice([24, 48, 120]) * MiB
        room = budget - weights - outside - inp - 20 * MiB - graph_bytes
        plan0 = int((room - charge_of(0, ext)) * rng.uniform(0.1, 1.0)) // GRAN * GRAN
        shapes = rng.sample(range(8), 3)
        steps = [(plan0, ext, shapes[0])] + [(plan0 // 3 // GRAN * GRAN, rng.choice([0, ext]), rng.choice(shapes[1:]))
                                             for _ in range(rng.randint(2, 8))]
        backend.transient_bytes = ext
        run_request(dev, guard, graphs, inp, steps, graph_bytes, room)
        assert backend.held <= graph_bytes
    assert graphs.stats.captures > 10 and graphs.stats.replays > 10
    assert dev.peak <= budget, f"over the budget by {(dev.peak - budget) / MiB:.0f} MiB"


def test_the_engine_captures_under_a_guard_into_its_pool_with_the_eager_tokens():
    model = random_model("llada")
    opts = dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.9)
    ref = MosaicEngine(model, {"progress": False}).generate([3, 4, 5], **opts)
    eng = MosaicEngine(model, {"progress": False, "memory_budget": "1GiB"})
    backend = SimBackend()
    eng.memory.use_guard(DeviceGuard(backend, eng.budget.budget_bytes, outside_bytes=0))
    fake = FakeGraphs(driver_bytes=MiB)
    graphs = StepGraphs(fake)
    graphs.bytes_per_op = 1024
    eng.use_graphs(graphs)
    outs = [eng.generate([3, 4, 5], **opts) for _ in range(2)]
    assert all(torch.equal(o.tokens, ref.tokens) for o in outs)
    g = outs[1].stats["graphs"]
    assert g["mode"] == "captured" and g["replays"] > 0 and g["charged_bytes"] > 0
    assert eng.guard.keep and all(p is not None for p in fake.pools)
    assert graphs.stats.driver_bytes <= eng.guard.graph_bytes
    assert backend.limit is None                           # lifted after the request


def test_the_cap_leaves_pytorch_no_room_for_the_graphs_executables():
    """The backstop: whatever PyTorch is asked for beyond the charges meets the cap, which
    counts the graphs' executables (outside PyTorch) as held."""
    import pytest

    from mosaic.memory.caching import SimOOM
    outside, weights, budget = 500 * MiB, 2000 * MiB, 4000 * MiB
    dev, w, guard, graphs, backend = _setup(budget, outside, weights, driver_bytes=40 * MiB)
    steps = [(200 * MiB, 30 * MiB, 1)] * 3
    room = budget - weights - outside - 20 * MiB - 40 * MiB
    run_request(dev, guard, graphs, 40 * MiB, steps, 120 * MiB, room - 120 * MiB)
    assert backend.held == 40 * MiB
    engine_mod.guard_step(guard, dev.arena, _prepared(200 * MiB, 30 * MiB, 1))   # a step's cap, then a rogue tensor
    with pytest.raises(SimOOM):
        dev.backend.malloc(budget)
    big = dev.backend.default.limit - dev.backend.reserved()
    if big > 0:
        dev.backend.free(dev.backend.malloc(big - GRAN))
    assert dev.peak <= budget


class FailOnce(FakeGraphs):
    """The first capture fails; a capture into the pool it used fails too ("already recording":
    the allocator was left recording into it); any other pool works."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.tried, self.bad = 0, None

    def capture(self, fn, pool=None, draws=False):
        self.tried += 1
        if self.tried == 1:
            self.bad = pool[0]
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        if pool is not None and pool[0] is self.bad:
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        return super().capture(fn, pool, draws)


def test_a_failed_capture_gives_up_its_pool_and_later_captures_work():
    outside, weights, budget = 500 * MiB, 2000 * MiB, 4000 * MiB
    dev, w, guard, graphs, _ = _setup(budget, outside, weights, driver_bytes=8 * MiB)
    backend = FailOnce(driver_bytes=8 * MiB, device=dev)
    graphs.backend = backend
    graphs.bind(graphs.allowed, guard.graph_pool, guard.drop_pool)
    steps = [(200 * MiB, 300 * MiB, s) for s in (0, 1) for _ in range(4)]
    room = budget - weights - outside - 20 * MiB - 40 * MiB
    run_request(dev, guard, graphs, 40 * MiB, steps, 64 * MiB, room - 64 * MiB)
    st = graphs.stats
    assert len(st.failures) == 1 and "previous error" in st.failures[0], st.failures
    assert st.captures == 1 and st.replays == 3 and graphs.allowed()     # shape 1 captured into a new pool
    assert backend.pools[-1][0] is guard._pool is not backend.bad
    assert dev.peak <= budget
