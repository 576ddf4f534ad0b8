"""Where captured Dream dual-cache steps part from eager ones, on the GPU (skipped without CUDA).
On the H200, Dream with cache dual, threshold 0.9 and temperature 0.2 / top_p 0.95 (seed 7)
gave other tokens captured than eager, while Dream without a cache and LLaDA dual matched
(bench/results/gpu/session7/gpu_tests_graphs_batched_2a23023.log). No GPU test ran Dream's
dual cache captured at all, greedy included. These tests run both engines step by step and name
the first step whose outputs differ (its kind, masked count, and whether it was a replay, a
capture, an eager run or a redo), for greedy and sampled Dream, dual and prefix."""

import pytest
import torch
from conftest import needs_cuda

from mosaic import MosaicEngine, load

pytestmark = [pytest.mark.gpu, needs_cuda]
BASE = dict(max_new_tokens=64, steps=64, block_length=16, threshold=0.9)


@pytest.fixture(scope="module")
def dream():
    return load("dream-7b", device="cuda", num_layers=2)


def _recording(eng):
    """eng's steps as [(cache mode, masked rows, graph counters' change, x0, conf)]."""
    steps, execute = [], eng.executor.execute

    def record(step, state):
        st = eng.graphs.stats.snapshot() if eng.graphs is not None else {}
        outs = execute(step, state)
        now = eng.graphs.stats.snapshot() if eng.graphs is not None else {}
        moved = {k: now[k] - st[k] for k in now if now[k] != st[k]}
        mode = step.cache.mode if step.cache is not None else None
        steps.append((mode, step.num_masked, moved, outs["x0"].cpu(), outs.get("conf", outs["x0"]).float().cpu()))
        return outs
    eng.executor.execute = record
    return steps


def _first_difference(a, b) -> str | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if not (torch.equal(x[3], y[3]) and torch.equal(x[4], y[4])):
            rows = (x[3] != y[3]).nonzero().flatten().tolist()
            return (f"step {i} ({x[0]}, {x[1]} masked rows, graphs {y[2]}): x0 differs at rows {rows[:8]}, "
                    f"conf max |diff| {float((x[4] - y[4]).abs().max()):.3g}; steps before it equal")
    return None if len(a) == len(b) else f"{len(a)} eager steps vs {len(b)} captured"


@pytest.mark.parametrize("cache", ["dual", "prefix"])
@pytest.mark.parametrize("drawn", [dict(), dict(temperature=0.2, seed=7), dict(temperature=0.2, top_p=0.95, seed=7)])
def test_captured_dream_block_steps_equal_eager_step_by_step(dream, cache, drawn):
    kw = BASE | {"cache": cache} | drawn
    g = torch.Generator().manual_seed(0)
    prompt = [t for t in torch.randint(10, 1000, (200,), generator=g).tolist() if t != dream.cfg.mask_id]
    eager = MosaicEngine(dream, {"progress": False, "cuda_graphs": "off"})
    graphs = MosaicEngine(dream, {"progress": False})
    ref = _recording(eager)
    want = eager.generate(prompt, **kw)
    for run in range(3):
        got = _recording(graphs)
        out = graphs.generate(prompt, **kw)
        graphs.executor.execute = type(graphs.executor).execute.__get__(graphs.executor)
        where = _first_difference(ref, got)
        assert where is None and torch.equal(out.tokens, want.tokens), f"run {run}: {where}"
    st = graphs.graphs.stats
    assert st.replays > 0 and not st.failures, st.as_dict()
