"""Random draws inside captured steps (runtime/graphs.py, runtime/graph_backend.py) on the CPU:
the captured formulation of the published draws equals the published code bit for bit, and a
fake backend whose replays re-run the captured step (from its own generator, loaded with the
request's stream, rows padded to the step's largest count) gives the eager draws and tokens, with
the request's stream advanced as the eager step advances it."""

import pytest
import torch
from conftest import random_model
from fake_graphs import CapturingGraphs, FakeGraphs

from mosaic import MosaicEngine
from mosaic.runtime import published as P
from mosaic.runtime.graph_backend import philox_increment
from mosaic.runtime.graphs import StepGraphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multinomial_one_is_torch_multinomial_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(7, 301, generator=g) * 3, dim=-1).to(dtype)
    for seed in range(5):
        want = torch.multinomial(probs, 1, True, generator=torch.Generator().manual_seed(seed))
        got, ok = P.multinomial_one(probs, torch.Generator().manual_seed(seed))
        assert torch.equal(got, want) and bool(ok)
    bad = probs.clone()
    bad[2, 5] = float("nan")
    assert not bool(P.multinomial_one(bad)[1])


@pytest.mark.parametrize("kw", [dict(temperature=0.2, top_p=0.95), dict(temperature=0.7, top_k=5),
                                dict(temperature=1.0, margin_confidence=True), dict(temperature=0.5, neg_entropy=True),
                                dict(temperature=0.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_captured_sample_tokens_is_the_published_one(kw, dtype):
    """The same values, and ok exactly where the published code drew (where Categorical's
    simplex check fails, as bfloat16 probabilities summing to 1.0078 make it, it takes the
    argmax without a draw: the captured step then reruns eagerly)."""
    drew = []
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        logits = (torch.randn(9, 101, generator=g) * 4).to(dtype)
        ref_gen = torch.Generator().manual_seed(5)
        want = P.sample_tokens(logits, generator=ref_gen, **kw)
        conf, x0, ok, flag = P.sample_tokens_captured(logits, generator=torch.Generator().manual_seed(5), **kw)
        assert torch.equal(x0, want[1]) and torch.equal(conf, want[0])
        did_draw = not torch.equal(ref_gen.get_state(), torch.Generator().manual_seed(5).get_state())
        # a failed simplex check is the argmax without a draw: the step stands (ok), drew False
        assert bool(ok) and bool(flag) == (did_draw or kw["temperature"] == 0)
        drew.append(did_draw)
    assert kw["temperature"] == 0 or any(drew)


def test_a_host_branch_of_the_published_code_is_flagged_not_taken():
    logits = torch.full((2, 11), 60000.0, dtype=torch.float16)       # / 1e-4 overflows float16
    assert not bool(P.sample_tokens_captured(logits, temperature=1e-4, generator=torch.Generator())[2])


def test_philox_increment_follows_aten():
    # 132 SMs x 8 blocks of 256 threads: one round covers 270,336 x 4 float (x 2 double) values
    assert philox_increment(1, torch.float32, 132) == 4
    assert philox_increment(270_336 * 4, torch.float32, 132) == 4
    assert philox_increment(270_336 * 4 + 1, torch.float32, 132) == 8
    assert philox_increment(270_336 * 2 + 1, torch.float64, 132) == 8
    assert philox_increment(0, torch.float32, 132) == 0


def _pair(family, **cfg):
    model = random_model(family)
    ref = MosaicEngine(model, {"progress": False, **cfg})
    eng = MosaicEngine(model, {"progress": False, **cfg})
    fake = FakeGraphs()
    eng.use_graphs(StepGraphs(fake, vocab=model.cfg.vocab, dtype=model.dtype))
    return ref, eng, fake


@pytest.mark.parametrize("opts", [dict(temperature=0.2, top_p=0.95), dict(temperature=0.7, top_k=4),
                                  dict(temperature=0.5, block_length=4, cache="dual", threshold=0.9)])
def test_captured_dream_sampling_draws_the_eager_tokens(opts):
    ref, eng, fake = _pair("dream")
    kw = dict(max_new_tokens=8, steps=8, seed=11, **opts)
    want = ref.generate([3, 4, 5], **kw)
    for _ in range(2):
        got = eng.generate([3, 4, 5], **kw)
        assert torch.equal(got.tokens, want.tokens)
    st = eng.graphs.stats
    assert st.captures >= 1 and st.replays >= 4 and not st.failures and st.redone == 0
    assert got.stats["graphs"]["replays"] > 0


@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_captured_dream_bfloat16_sampling_stays_captured_with_the_eager_tokens(monkeypatch, cache):
    """bfloat16 probabilities often fail Categorical's simplex check (the published code then
    takes the argmax without a draw): the captured reducer (sample_tokens_captured, run as a
    capture runs it) gives that argmax itself and flags that nothing was drawn, so the replay
    stands with the request's stream where it was: the eager tokens and no step redone (on the
    H200 every such step was redone eagerly: Dream dual, temperature 0.2, top_p 0.95, 0.35x greedy)."""
    model = random_model("dream", dtype=torch.bfloat16)
    ref = MosaicEngine(model, {"progress": False})
    eng = MosaicEngine(model, {"progress": False})
    fake = CapturingGraphs()
    monkeypatch.setattr(P, "capturing", fake.capturing)
    eng.use_graphs(StepGraphs(fake, vocab=model.cfg.vocab, dtype=model.dtype))
    kw = dict(max_new_tokens=16, steps=16, block_length=4, cache=cache, threshold=0.9, temperature=0.2,
              top_p=0.95, seed=7)
    want = ref.generate(list(range(3, 40)), **kw)
    for _ in range(2):
        assert torch.equal(eng.generate(list(range(3, 40)), **kw).tokens, want.tokens)
    st = eng.graphs.stats
    assert st.replays > 0 and st.redone == 0 and not st.failures, st.as_dict()


def test_captured_draws_from_the_default_generator_continue_its_stream():
    ref, eng, fake = _pair("dream")
    kw = dict(max_new_tokens=8, steps=8, temperature=0.3)
    torch.manual_seed(5)
    want = [ref.generate([3, 4, 5], **kw).tokens for _ in range(2)]
    after_ref = torch.rand(3)
    torch.manual_seed(5)
    eng.generate([3, 4, 5], **kw)                       # the shape's eager run
    torch.manual_seed(5)
    got = [eng.generate([3, 4, 5], **kw).tokens for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(torch.rand(3), after_ref)         # the default stream advanced exactly as eager
    assert eng.graphs.stats.replays > 0


def test_a_replay_whose_draws_took_a_host_branch_is_rerun_eagerly():
    ref, eng, fake = _pair("dream")
    kw = dict(max_new_tokens=8, steps=8, temperature=0.5, seed=2)
    want = ref.generate([3, 4, 5], **kw)
    eng.generate([3, 4, 5], **kw)
    graphs = eng.graphs
    for got in graphs.graphs.values():                   # the flag the captured reducer would write
        got.outputs["ok"].fill_(False)
        fn = got.graph.fn
        got.graph.fn = lambda fn=fn, o=got.outputs["ok"]: (fn(), o.fill_(False))
    out = eng.generate([3, 4, 5], **kw)
    assert torch.equal(out.tokens, want.tokens) and graphs.stats.redone >= 1


def test_seeded_sampled_runs_repeat_exactly_with_graphs():
    _, eng, _ = _pair("dream")
    kw = dict(max_new_tokens=8, steps=8, temperature=0.9, top_p=0.9, seed=123)
    runs = [eng.generate([7, 8, 9], **kw).tokens for _ in range(3)]
    assert all(torch.equal(r, runs[0]) for r in runs) and eng.graphs.stats.replays > 0


@pytest.mark.parametrize("opts", [dict(block_length=4), dict(block_length=4, cache="dual", threshold=0.9),
                                  dict(block_length=4, cache="prefix", threshold=0.9)])
def test_captured_llada_noise_draws_the_eager_tokens(monkeypatch, opts):
    """LLaDA's GPU stream (one uniform draw per chunk of rows, not the CPU's reference order),
    forced on the CPU: captured steps (rows padded) draw the eager noise for the real rows."""
    from mosaic.runtime import reducers
    init = reducers.NoiseStream.__init__

    def counter_based(self, *a, **k):
        init(self, *a, **k)
        self.in_order = False
    monkeypatch.setattr(reducers.NoiseStream, "__init__", counter_based)
    ref, eng, _ = _pair("llada")
    kw = dict(max_new_tokens=8, steps=8, temperature=0.7, seed=4, **opts)
    want = ref.generate([3, 4, 5], **kw)
    for _ in range(2):
        assert torch.equal(eng.generate([3, 4, 5], **kw).tokens, want.tokens)
    st = eng.graphs.stats
    assert st.captures >= 1 and st.replays >= 3 and not st.failures


def test_captured_llada2_multinomial_draws_the_eager_tokens():
    ref, eng, _ = _pair("llada2")
    kw = dict(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=3)
    want = ref.generate([3, 4, 5], **kw)
    for _ in range(2):
        assert torch.equal(eng.generate([3, 4, 5], **kw).tokens, want.tokens)
    assert eng.graphs.stats.replays > 0 and not eng.graphs.stats.failures


def test_captured_llada_noise_reads_nothing_on_the_host(monkeypatch):
    from test_graphs import StrictGraphs

    from mosaic.runtime import reducers
    init = reducers.NoiseStream.__init__

    def counter_based(self, *a, **k):
        init(self, *a, **k)
        self.in_order = False
    monkeypatch.setattr(reducers.NoiseStream, "__init__", counter_based)
    eng = MosaicEngine(random_model("llada"), {"progress": False})
    eng.use_graphs(StepGraphs(StrictGraphs()))
    for opts in (dict(block_length=4), dict(block_length=4, cache="dual", threshold=0.9)):
        eng.generate([[3, 4, 5], [6, 7, 8, 9, 10]], max_new_tokens=8, steps=8, temperature=0.7, seed=1, **opts)
    assert eng.graphs.stats.captures >= 2 and not eng.graphs.stats.failures, eng.graphs.stats.failures


def test_stacked_requests_that_draw_are_not_captured():
    """Several requests' reducers stacked (engine/batching.py) draw from several generators: one
    graph cannot replay them, so such a step stays eager."""
    from mosaic.config import GenerationConfig
    from mosaic.engine.batching import StackedReducer
    from mosaic.runtime.graph_rules import draw_problem
    from mosaic.runtime.reducers import DreamReducer
    hot = DreamReducer(GenerationConfig(temperature=0.5), None, True)
    cold = DreamReducer(GenerationConfig(), None, True)
    assert draw_problem(StackedReducer([hot, hot], [2, 3]), None) == "random draws"
    assert draw_problem(StackedReducer([cold, cold], [2, 3]), None) is None
    assert draw_problem(hot, None) is None


@pytest.mark.parametrize("top_p", [0.95, None])
def test_one_row_top_p_steps_run_eager(top_p):
    """top-p's cumsum over one row is not the padded step's on CUDA (CUB's device-wide scan; the
    H200's Dream top_p 0.95 tokens parted there): a step with one masked row of a larger planned
    count runs eager when the reducer cuts by top-p, and the tokens stay the eager ones."""
    ref, eng, fake = _pair("dream")
    kw = dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.99, temperature=0.5,
              seed=3) | ({"top_p": top_p} if top_p else {})
    want = ref.generate([3, 4, 5], **kw)
    seen, execute = [], eng.executor.execute
    eng.executor.execute = lambda step, state: seen.append(step.num_masked) or execute(step, state)
    for _ in range(2):
        assert torch.equal(eng.generate([3, 4, 5], **kw).tokens, want.tokens)
    st = eng.graphs.stats
    ones = seen.count(1)
    assert st.replays > 0 and ones > 0 and st.one_row == (ones if top_p else 0), (seen, st.as_dict())
