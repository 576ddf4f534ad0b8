"""LLaDA2's batched block step (models/block_cache.py): a batch's (sequence, block) attention
entries, the batch's tokens equal to the per-block path's and to each prompt alone (CPU float32),
with the loop and with the gather kernel (device tensors only: what a captured step replays), and
the batched step reads nothing back to the host (meta tensors)."""

import dataclasses

import pytest
import torch
from conftest import TINY, random_model
from fake_graphs import FakeGraphs

from mosaic import MosaicEngine
from mosaic.config import GenerationConfig
from mosaic.graph.ctx import EagerCtx
from mosaic.memory.kv_store import KVStore, StoreLayout
from mosaic.models import allocate
from mosaic.models.block_cache import BlockCacheStep, block_index, block_program, block_step
from mosaic.runtime.samplers.block_diffusion import BlockReducer


def test_entries_are_block_causal_per_sequence():
    spec = BlockCacheStep(a=4, hi=12, block=4, length=16)
    idx = block_index(spec, (0, 8), "cpu", "loop")
    e = idx.entries
    assert e.q_count == (4, 4, 4, 4) and e.q_first == (0, 4, 8, 12)
    # sequence 0 (no padding): blocks [4, 8) and [8, 12) see keys [0, 8) and [0, 12) of row 0;
    # sequence 1 (padding 8): its first block lies in the padding (no keys), its second sees [8, 12)
    assert e.k_first == (0, 0, 24, 24) and e.k_count == (8, 12, 0, 4)
    assert idx.write_rows.tolist() == [*range(4, 12), *range(20, 28)]


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [3, 5], [8, 9, 7, 9, 3, 2]]
OPTS = dict(max_new_tokens=10, block_length=4, steps=3, threshold=0.6)


def _tokens(model, prompts, **cfg):
    out = MosaicEngine(model, {"progress": False, **cfg}).generate(prompts, **OPTS)
    return out.tokens, out


@pytest.mark.parametrize("varlen", ["loop", "gather"])
def test_batched_block_steps_give_each_prompts_tokens_alone(varlen):
    model = random_model("llada2", seed=2)
    batch, out = _tokens(model, PROMPTS, varlen_kernel=varlen)
    for b, p in enumerate(PROMPTS):
        alone, _ = _tokens(model, [p], varlen_kernel=varlen)
        assert batch[b].tolist() == alone[0].tolist(), (b, varlen)
    assert any(varlen in label for label in out.lossy) == (varlen != "loop")


def test_batched_and_per_block_attention_agree():
    model = random_model("llada2", seed=2)
    batched, _ = _tokens(model, PROMPTS)
    per_block, _ = _tokens(model, PROMPTS, chunks=(2, 1, 1))     # chunked attention: the per-block path
    assert torch.equal(batched, per_block)


@pytest.mark.parametrize("kernel", ["gather", "flash"])
def test_batched_block_step_reads_nothing_on_the_host(kernel):
    cfg = dataclasses.replace(TINY["llada2"], ffn=16)            # bf16 rows of whole 16 bytes
    dev, bf = torch.device("meta"), torch.bfloat16
    model = allocate(cfg, "meta", bf, name="meta")[0]
    B, W, block = 2, 16, 4
    layout = StoreLayout.of(cfg, B, W, 2)
    store = KVStore(layout, dev, bf)
    spec = BlockCacheStep(4, 12, block, W, store, layout.device_bytes)
    step = block_step(torch.zeros(B, W, dtype=torch.long, device=dev), (0, 4), spec, kernel,
                      rows=torch.zeros(6, dtype=torch.long, device=dev),
                      reducer=BlockReducer(GenerationConfig(max_new_tokens=8), None))
    assert step.cache.index is not None
    store.begin("block", 4, W)
    out = block_program(EagerCtx(dev, bf, moe_kernel="grouped"), model, step)
    assert out["x0"].shape == (6,)


@pytest.mark.parametrize("varlen, graphs", [("loop", False), ("gather", True)])
def test_requests_block_steps_stack_across_requests(varlen, graphs):
    """Continuous batching (the Scheduler's rounds, engine/batching.RoundExecutor): LLaDA2
    requests of different prompt lengths, at different block positions, run their block steps of
    equal rows as one stacked step over the paged pool, and every request gets its tokens alone.
    With the gather kernel (device tensors only) and a fake graph backend the stacked step is
    padded to its batch bucket with dummy sequences on the pool's scratch rows, captured once and
    replayed for other rounds."""
    from mosaic.engine.scheduler import Scheduler
    from mosaic.runtime.graphs import StepGraphs
    model = random_model("llada2", seed=2)
    eng = MosaicEngine(model, {"progress": False, "varlen_kernel": varlen})
    backend = FakeGraphs()
    if graphs:
        eng.runner.graphs = StepGraphs(backend)
    cases = [([3, 1, 4, 1, 5, 9, 2, 6, 5], dict(max_new_tokens=10, block_length=4, steps=3, threshold=0.6)),
             ([3, 5], dict(max_new_tokens=8, block_length=4, steps=4)),
             ([8, 9, 7, 9, 3, 2], dict(max_new_tokens=12, block_length=4, steps=2, threshold=0.9))]
    ref = [eng.generate([p], **o).tokens for p, o in cases]
    sched = Scheduler(eng)
    runs = [eng.start(eng.request([p], **o)) for p, o in cases]
    for run in runs:
        sched.add(run)
    ended = sched.run_all()
    assert all(f.error is None for f in ended), [f.error for f in ended]
    got = {id(f.run): f.generation.tokens for f in ended}
    for run, want in zip(runs, ref):
        assert torch.equal(got[id(run)], want)
    stats = sched.executor.stats
    assert not stats.fallbacks, stats.fallbacks
    assert stats.stacked_steps > 0
    if graphs:
        keys = [k for k in eng.runner.graphs.graphs if k[3] and k[3][0] == "pool"]
        assert keys and eng.runner.graphs.stats.replays > backend.captured, eng.runner.graphs.stats


def test_seeded_sampled_requests_stack_with_their_own_streams():
    """At temperature > 0 each stacked request draws from its own generator over its own rows
    (StackedReducer, not uniform): the tokens each seeded request gets alone."""
    from mosaic.engine.scheduler import Scheduler
    eng = MosaicEngine(random_model("llada2", seed=2), {"progress": False})
    opts = dict(max_new_tokens=8, block_length=4, steps=3, threshold=0.6, temperature=0.8)
    cases = [([3, 1, 4, 1, 5, 9, 2, 6, 5], 1), ([3, 5], 2), ([8, 9, 7, 9, 3, 2], 3)]
    ref = [eng.generate([p], seed=s, **opts).tokens for p, s in cases]
    sched = Scheduler(eng)
    runs = [eng.start(eng.request([p], seed=s, **opts)) for p, s in cases]
    for run in runs:
        sched.add(run)
    ended = {id(f.run): f for f in sched.run_all()}
    for run, want in zip(runs, ref):
        assert ended[id(run)].error is None and torch.equal(ended[id(run)].generation.tokens, want)
    assert sched.stats.stacked_steps > 0 and not sched.stats.fallbacks
