"""Captured steps' bookkeeping on the CPU (runtime/graphs.py): a fake backend whose 'graph' re-runs
the captured function, so keys, padding, capture on the second run, replay, fallback and the LRU
are checked without a GPU; tokens must equal the eager engine's."""

import types

import pytest
import torch
from conftest import left_padded, random_model
from fake_graphs import FakeGraphs, _Graph

from mosaic import MosaicEngine
from mosaic.config import GenerationConfig
from mosaic.runtime import published
from mosaic.runtime.graphs import StepGraphs, eligible


def _engine(model, **cfg):
    return MosaicEngine(model, {"progress": False, **cfg})


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_replayed_steps_give_the_eager_tokens(family):
    model = random_model(family)
    opts = dict(max_new_tokens=8, steps=8, **({"block_length": 4} if family == "llada" else {}))
    ref = _engine(model).generate([3, 4, 5], **opts)
    eng = _engine(model)
    backend = FakeGraphs()
    eng.runner.graphs = StepGraphs(backend)
    out = eng.generate([3, 4, 5], **opts)
    assert torch.equal(out.tokens, ref.tokens)
    st = eng.runner.graphs.stats
    # one shape: eager once, captured on its second run, then replayed (captures count as replays)
    assert st.eager == 1 and st.captures == 1 and st.replays == 7 and backend.captured == 1
    again = eng.generate([3, 4, 5], **opts)                   # a second request: replays only
    assert torch.equal(again.tokens, ref.tokens) and st.captures == 1 and st.replays == 15


def test_dual_cache_block_steps_get_a_graph_per_block():
    model = random_model("llada")
    opts = dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.99)
    ref = _engine(model).generate([3, 4, 5], **opts)
    eng = _engine(model)
    eng.runner.graphs = StepGraphs(FakeGraphs())
    out = eng.generate([3, 4, 5], **opts)
    assert torch.equal(out.tokens, ref.tokens)
    keys = {k[3] for k in eng.runner.graphs.graphs}
    assert {k[1:3] for k in keys if k and k[0] == "block"} == {(3, 7), (7, 11)}   # rows [lo, hi) per block


def test_a_capture_that_fails_leaves_the_shape_eager():
    model = random_model("llada")
    ref = _engine(model).generate([3, 4, 5], max_new_tokens=6, steps=6)
    eng = _engine(model)
    eng.runner.graphs = StepGraphs(FakeGraphs(fail=True))
    out = eng.generate([3, 4, 5], max_new_tokens=6, steps=6)
    st = eng.runner.graphs.stats
    assert torch.equal(out.tokens, ref.tokens)
    assert st.captures == 0 and st.replays == 0 and len(st.failures) == 1 and "capturing" in st.failures[0]


def test_cfg_is_not_captured():
    model = random_model("llada")
    eng = _engine(model)
    eng.runner.graphs = StepGraphs(FakeGraphs())
    eng.generate([3, 4, 5], max_new_tokens=4, steps=4, cfg_scale=1.0)
    assert eng.runner.graphs.stats.captures == 0 and eng.runner.graphs.stats.eager == 0


def test_rows_are_padded_to_the_planned_count_and_the_lru_is_bounded():
    inputs = {"ids": torch.zeros(1, 2, dtype=torch.long), "positions": torch.zeros(1, 2, dtype=torch.long),
              "rows": torch.zeros(5, dtype=torch.long)}
    step = types.SimpleNamespace(ids=torch.tensor([[7, 8]]), positions=torch.tensor([[0, 1]]),
                                 rows=torch.tensor([4, 9]), cache=None)
    StepGraphs._write(inputs, step, 2, 5)
    assert inputs["rows"].tolist() == [4, 9, 9, 9, 9] and inputs["ids"].tolist() == [[7, 8]]
    model = random_model("llada")
    eng = _engine(model)
    graphs = eng.runner.graphs = StepGraphs(FakeGraphs(), max_graphs=2)
    for n in (3, 4, 5, 6):   # four prompt lengths: four shapes, two graphs kept
        for _ in range(2):
            eng.generate(list(range(3, 3 + n)), max_new_tokens=4, steps=4)
    assert len(graphs.graphs) == 2 and graphs.stats.captures == 4


def test_eligibility_names_the_reason():
    model = random_model("llada")
    eng = _engine(model)
    eng.generate([3, 4, 5], max_new_tokens=4, steps=4)
    from mosaic.policy.probe import probe_step
    step = probe_step(model, 8, 4)
    assert eligible(step, None) is None
    hot = probe_step(model, 8, 4, GenerationConfig(temperature=0.7))
    assert eligible(hot, None, can_draw=False) == "random draws"
    assert eligible(hot, None) == "noise in the reference's row order (CPU)"   # the CPU's LLaDA stream


class NoHostReads:
    """What stream capture forbids, made to fail on the CPU: reading a tensor's values on the
    host (bool(), item(), tolist(), int(), float()) inside a step program would stop a CUDA graph
    capture ('operation not permitted when stream is capturing')."""
    NAMES = ("__bool__", "item", "tolist", "__int__", "__float__")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}
        self.capturing = published.capturing
        published.capturing = lambda: True          # as torch.cuda.is_current_stream_capturing() says then

        def refuse(name):
            def f(*a, **k):
                raise RuntimeError(f"host read ({name}) inside a step program: a CUDA graph cannot capture it")
            return f
        for n in self.NAMES:
            setattr(torch.Tensor, n, refuse(n))
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)
        published.capturing = self.capturing


class StrictGraphs(FakeGraphs):
    def capture(self, fn, pool=None, draws=False):
        with NoHostReads():
            outs = fn()
        self.captured += 1
        return _Graph(self, fn), outs


@pytest.mark.parametrize("family, opts", [
    ("llada", dict(max_new_tokens=8, steps=8, block_length=4)),
    ("llada", dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.9)),
    ("llada", dict(max_new_tokens=8, steps=8, block_length=4, cache="prefix", threshold=0.9)),
    ("dream", dict(max_new_tokens=8, steps=8)),
    ("dream", dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.9)),
    ("dream", dict(max_new_tokens=8, steps=8, temperature=0.2, top_p=0.95, seed=1)),
    ("dream", dict(max_new_tokens=8, steps=8, temperature=0.7, top_k=4, alg="topk_margin", seed=1)),
])
def test_captured_step_programs_read_nothing_on_the_host(family, opts):
    """A batch of two padded prompts: every eligible step's program runs without a host read
    (the GPU run of 2026-12-01 found a NaN check that synchronised inside the dual-cache step)."""
    model = random_model(family)
    eng = _engine(model)
    eng.runner.graphs = StepGraphs(StrictGraphs())
    inputs, mask = left_padded(model.cfg, [[3, 4, 5], [6, 7, 8, 9, 10]])    # one request of two padded rows
    eng.generate(inputs=inputs, attention_mask=mask, **opts)
    st = eng.runner.graphs.stats
    assert not st.failures, st.failures
    assert st.captures >= 1


class PoisonedGraphs(FakeGraphs):
    """Every capture fails the way PyTorch's allocator does once a failed capture left it routing
    into the pool (pytorch#190308)."""

    def capture(self, fn, pool=None, draws=False):
        self.captured += 1
        raise RuntimeError("beginAllocateToPool: already recording to mempool_id")


def test_a_capture_that_leaves_the_allocator_recording_turns_capture_off_for_good():
    model = random_model("llada")
    opts = dict(max_new_tokens=8, steps=8, block_length=4)
    ref = _engine(model).generate([3, 4, 5], **opts)
    eng = _engine(model)
    backend = PoisonedGraphs()
    eng.runner.graphs = StepGraphs(backend)
    assert torch.equal(eng.generate([3, 4, 5], **opts).tokens, ref.tokens)
    assert torch.equal(eng.generate([3, 4, 5, 6], **opts).tokens, _engine(model).generate([3, 4, 5, 6], **opts).tokens)
    # one attempt, then no other shape is tried: every later step runs eager
    assert backend.captured == 1 and not eng.runner.graphs.allowed()
    assert "already recording" in eng.runner.graphs.stats.failures[0]


BATCHED = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13], [5, 6], [9, 10, 11], [4, 4, 4, 4, 4]]


def _batched_run(model, backend, opts, join_every: int = 2, **cfg):
    """The BATCHED prompts through one Scheduler, joining every `join_every` rounds (so rounds of
    1..5 sequences run, and leave, at different times), engine options `cfg`; (tokens per
    request, engine)."""
    from mosaic.engine.scheduler import Scheduler
    eng = _engine(model, **cfg)
    eng.runner.graphs = StepGraphs(backend)
    sched, runs, i = Scheduler(eng), [eng.start(eng.request(p, **opts)) for p in BATCHED], 0
    while i < 400 and (sched.has_work or i // join_every < len(runs)):
        if i % join_every == 0 and i // join_every < len(runs):
            sched.add(runs[i // join_every])
        assert not any(f.error for f in sched.step())
        i += 1
    assert not sched.stats.fallbacks, sched.stats.fallbacks         # every stacked step ran stacked
    return [run.result().tokens for run in runs], eng


def test_batched_block_steps_replay_one_graph_per_batch_bucket():
    """With a kernel that reads only device tensors (gather: the CPU's stand-in for flash), a
    stacked block step is padded to its batch bucket and its rows are graph inputs, so rounds
    of different members and sizes replay the same graph; tokens equal the same padded steps run
    eager, and no captured program reads a value on the host."""
    model = random_model("llada")
    opts = dict(max_new_tokens=16, steps=16, block_length=4, cache="dual", threshold=1.0)
    want, _ = _batched_run(model, FakeGraphs(fail=True), opts, 1, varlen_kernel="gather")   # padded, all eager
    got, eng = _batched_run(model, StrictGraphs(), opts, 1, varlen_kernel="gather")
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    g = eng.runner.graphs
    assert not g.stats.failures, g.stats.failures
    pooled = {k: c for k, c in g.graphs.items() if k[3] and k[3][0] == "pool"}
    assert pooled and {k[1][0] for k in pooled} <= {2, 4, 8}                  # batch buckets, not 3, 5
    assert max(c.replays for c in pooled.values()) >= 5                     # one graph, many rounds
    assert eng.executor.kv_pool.allocated_pages == eng.executor.kv_pool.scratch.pages   # stores gave theirs back


def test_the_loop_kernel_keys_its_graph_by_the_sequences_offsets():
    """The loop (the CPU default, batch-invariant mode) reads each sequence's offsets on the host:
    a captured loop step is keyed by them, never replayed for other members; no padding."""
    model = random_model("llada")
    opts = dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.9)
    ref = [_engine(model).generate(p, **opts).tokens for p in BATCHED]
    got, eng = _batched_run(model, FakeGraphs(), opts)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)                                            # each alone: the loop is exact
    pooled = [k for k in eng.runner.graphs.graphs if k[3] and k[3][0] == "pool"]
    assert pooled and all(k[3][2][0] == "loop" and len(k[3][2]) == 5 for k in pooled)
    assert eng.executor.kv_pool.scratch is None                             # no dummies: no padding

