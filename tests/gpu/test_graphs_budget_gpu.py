"""Captured steps under a memory budget and with random draws, on the GPU (skipped without
CUDA): the tokens equal the eager path's (cuda_graphs off) with and without a budget, seeded
sampling repeats and equals eager, captures really happen under the budget into the guard's
pool, and the driver's counter (NVML, sampled every 2 ms) stays inside the budget."""

import gc

import pytest
import torch
from conftest import needs_cuda

from mosaic import MosaicEngine, load

pytestmark = [pytest.mark.gpu, needs_cuda]
GiB = 2**30


def _settle():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def llada():
    return load("llada-8b", device="cuda", num_layers=2)


@pytest.fixture(scope="module")
def dream():
    return load("dream-7b", device="cuda", num_layers=2)


def _prompt(model, n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 1000, (n,), generator=g).tolist()
    return [t for t in ids if t != model.cfg.mask_id]


def _engines(model, budget):
    _settle()
    return (MosaicEngine(model, {"progress": False, "memory_budget": budget}),
            MosaicEngine(model, {"progress": False, "memory_budget": budget, "cuda_graphs": "off"}))


@pytest.mark.parametrize("opts", [dict(), dict(cache="dual", threshold=0.9), dict(cache="prefix", threshold=0.9)])
def test_captured_tokens_equal_eager_under_a_budget(llada, opts):
    kw = dict(max_new_tokens=64, steps=64, block_length=16, **opts)
    prompt = _prompt(llada)
    unbudgeted = MosaicEngine(llada, {"progress": False}).generate(prompt, **kw)
    graphs, eager = _engines(llada, "20GiB")
    for _ in range(2):
        got = graphs.generate(prompt, **kw)
        assert torch.equal(got.tokens, eager.generate(prompt, **kw).tokens)
        assert torch.equal(got.tokens, unbudgeted.tokens)
    g = got.stats["graphs"]
    assert g["mode"] == "captured" and g["replays"] > 0 and g["failures"] == 0, g
    assert graphs.guard.keep and graphs.graphs.stats.driver_bytes <= graphs.guard.graph_bytes


@pytest.mark.parametrize("family, opts", [
    ("llada", dict(temperature=0.7, block_length=16)),
    ("llada", dict(temperature=0.7, block_length=16, cache="dual", threshold=0.9)),
    ("dream", dict(temperature=0.2, top_p=0.95)),
    ("dream", dict(temperature=0.2, top_p=0.95, block_length=16, cache="dual", threshold=0.9)),
])
@pytest.mark.parametrize("budget", [None, "20GiB"])
def test_seeded_sampling_captured_equals_eager_and_repeats(llada, dream, family, opts, budget):
    model = llada if family == "llada" else dream
    kw = dict(max_new_tokens=64, steps=64, seed=7, **opts)
    prompt = _prompt(model)
    graphs, eager = _engines(model, budget)
    want = eager.generate(prompt, **kw)
    runs = [graphs.generate(prompt, **kw) for _ in range(3)]
    assert all(torch.equal(r.tokens, want.tokens) for r in runs)
    st = graphs.graphs.stats
    assert st.replays > 0 and not st.failures, st.as_dict()


def test_the_draw_offsets_follow_this_torch():
    from mosaic.runtime.graph_backend import CudaGraphs
    assert CudaGraphs(torch.device("cuda")).draw_problem is None


def test_a_capture_under_the_budget_takes_nothing_beyond_the_guards_pool(llada):
    eng, _ = _engines(llada, "20GiB")
    kw = dict(max_new_tokens=64, steps=64, block_length=16, cache="dual", threshold=0.9)
    prompt = _prompt(llada)
    eng.generate(prompt, **kw)
    out = eng.generate(prompt, **kw)
    st = eng.graphs.stats
    assert st.captures > 0 and eng.guard.keep, st.as_dict()
    segments = eng.guard._pool.snapshot()            # the guard's pool: still the one reserved segment
    assert sum(seg["total_size"] for seg in segments) == eng.guard.pool_size, segments
    assert out.stats["graphs"]["charged_bytes"] >= st.driver_bytes


def _budget_from_now(model, margin: int) -> int:
    """What the process holds now outside `model`'s own resident weights (the CUDA context,
    libraries, the other fixture model, and whatever earlier tests left alive: pytest keeps a
    failed test's engines in its traceback), plus the weights admission charges for `model` (a
    depth-truncated bench model is charged its full depth) and `margin` bytes for its workspace
    and requests. A fixed size failed after the other tests: 18 GiB against 14.93 GiB of
    weights and 4.27 GiB of context and workspace, about 2.9 GiB of it the Dream engines of the
    two failed tests (another model's weights count as 'others': the budget is the process's)."""
    from mosaic.engine.warmup import resident_weight_bytes
    from mosaic.memory.accounting import context_bytes
    _settle()
    held = context_bytes(torch.device("cuda")) + torch.cuda.memory_reserved()
    return held - resident_weight_bytes(model) + model.weight_bytes() + margin


def test_the_drivers_counter_stays_inside_the_budget_with_graphs(llada, dream):
    from mosaic.memory.device_meter import DeviceMeter
    _settle()
    meter = DeviceMeter(mode="process").start()
    try:
        # margins as the fixed 18 / 16 / 40 GiB left a fresh process above the charged weights
        for model, margin in ((llada, 3 * GiB), (dream, 2 * GiB), (llada, 25 * GiB)):
            budget = _budget_from_now(model, margin)
            eng = MosaicEngine(model, {"progress": False, "memory_budget": budget})
            mem = eng.memory
            why = dict(budget=budget, context=mem.context_driver_bytes, others=mem.others_bytes,
                       workspace=eng.budget.workspace_bytes, weights=eng.budget.weights_bytes)
            plain = dict(max_new_tokens=128, steps=128) | ({} if model is dream else dict(block_length=32))
            for kw in (plain,   # Dream's uncached sampler takes no block_length (an InputError)
                       dict(max_new_tokens=128, steps=128, block_length=32, cache="dual", threshold=0.9),
                       dict(max_new_tokens=64, steps=64, temperature=0.5, seed=1)):
                for n in (300, 3000):
                    with meter.window() as w:
                        out = eng.generate(_prompt(model, n), **kw)
                    assert w.peak_bytes <= eng.budget.budget_bytes, (why, kw, n, w.peak_bytes, out.stats)
            eng.close()
            del eng
            _settle()
    finally:
        meter.stop()


def test_a_budgeted_batch_replays_its_stacked_steps_inside_the_budget(llada):
    """Four dual-cache requests of different lengths run together under a budget: their stacked
    steps are captured under the batch's charge (engine/batch_memory.py: under one request's they
    all ran eager) and replayed by the next batch, the tokens equal the eager engine's, and the
    driver's counter stays inside the budget."""
    from mosaic.memory.device_meter import DeviceMeter
    kw = dict(max_new_tokens=64, steps=64, block_length=16, cache="dual", threshold=0.9)
    prompts = [_prompt(llada, n, seed=n) for n in (150, 200, 260, 300)]
    budget = _budget_from_now(llada, 4 * GiB)
    graphs, eager = _engines(llada, budget)
    want = eager.generate(prompts, **kw)
    meter = DeviceMeter(mode="process").start()
    try:
        with meter.window() as w:
            outs = [graphs.generate(prompts, **kw) for _ in range(2)]
    finally:
        meter.stop()
    assert all(torch.equal(o.tokens, want.tokens) for o in outs)
    st = graphs.graphs.stats
    assert st.replays > 0 and not st.failures, st.as_dict()
    assert outs[1].stats["graphs"]["captures"] == 0, outs[1].stats["graphs"]
    assert w.peak_bytes <= graphs.budget.budget_bytes, (w.peak_bytes, graphs.budget.budget_bytes)
