"""MoE steps through the captured-step bookkeeping (runtime/graphs.py) on the CPU, with a fake
backend whose 'graph' re-runs the captured function: LLaDA-MoE and LLaDA2 block steps are
captured and replayed with the eager tokens; a model whose experts run the per-expert loop (which
reads its group sizes on the host) is never offered for capture."""

import torch
from conftest import random_model
from fake_graphs import FakeGraphs

from mosaic import MosaicEngine
from mosaic.runtime.graphs import StepGraphs


def _run(model, opts, **cfg):
    eng = MosaicEngine(model, {"progress": False, **cfg})
    backend = FakeGraphs()
    eng.runner.graphs = StepGraphs(backend)
    return eng, backend, eng.generate([[3, 4, 5, 6, 7]], **opts)


def test_llada_moe_steps_are_captured_with_the_eager_tokens():
    model = random_model("llada_moe")
    opts = dict(max_new_tokens=8, steps=8, block_length=4)
    ref = MosaicEngine(model, {"progress": False}).generate([[3, 4, 5, 6, 7]], **opts)
    eng, backend, out = _run(model, opts)
    st = eng.runner.graphs.stats
    assert torch.equal(out.tokens, ref.tokens)
    assert st.captures == backend.captured == 1 and st.replays == 7 and not st.failures


def test_llada2_block_steps_are_captured_per_block():
    model = random_model("llada2")
    opts = dict(max_new_tokens=8, steps=4, block_length=4, threshold=1.0)
    ref = MosaicEngine(model, {"progress": False}).generate([[3, 4, 5, 6, 7]], **opts)
    eng, backend, out = _run(model, opts)
    st = eng.runner.graphs.stats
    assert torch.equal(out.tokens, ref.tokens)
    assert st.captures >= 2 and st.replays > st.captures and not st.failures, st
    # block steps are keyed by the canvas columns they run: [a, hi) per block
    assert {k[3][0] for k in eng.runner.graphs.graphs} == {"blocks"}


def test_the_expert_loop_is_never_offered_for_capture():
    model = random_model("llada_moe")
    eng, backend, _ = _run(model, dict(max_new_tokens=4, steps=4, block_length=4), moe_kernel="loop")
    st = eng.runner.graphs.stats
    assert backend.captured == 0 and st.captures == st.eager == 0 and not st.failures
