"""Continuous batching (engine/batching.py): requests of different lengths, joining at step
boundaries, stacked into one planned step, get exactly their tokens alone (CPU, float32)."""

import pytest
import torch
from conftest import random_model

from mosaic import MosaicEngine
from mosaic.engine.batching import Batch


def _engine(model, **cfg):
    return MosaicEngine(model, {"progress": False, **cfg})


def _alone(eng, prompt, **opts):
    return eng.generate(prompt, **opts).tokens


CASES = {
    "llada": [([3, 4, 5, 6], dict(max_new_tokens=8, steps=8, block_length=4)),
              ([7, 8, 9, 10, 11, 12, 13], dict(max_new_tokens=8, steps=8, block_length=4)),
              ([5, 6], dict(max_new_tokens=4, steps=4)),
              ([9, 10, 11], dict(max_new_tokens=8, steps=4, temperature=0.8, seed=3))],
    "dream": [([3, 4, 5, 6], dict(max_new_tokens=8, steps=8)),
              ([7, 8, 9, 10, 11, 12, 13], dict(max_new_tokens=6, steps=6, alg="entropy")),
              ([5, 6], dict(max_new_tokens=4, steps=4))],
    "llada_moe": [([3, 4, 5, 6], dict(max_new_tokens=8, steps=8, block_length=4)),
                  ([7, 8, 9, 10, 11], dict(max_new_tokens=8, steps=8, block_length=4))],
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_every_request_in_a_batch_gets_its_tokens_alone(family):
    model = random_model(family)
    eng = _engine(model)
    ref = [_alone(eng, p, **o) for p, o in CASES[family]]
    batch = Batch(eng)
    for p, o in CASES[family]:
        batch.add(eng.start(eng.request(p, **o)))
    outs = batch.run_all()
    for got, want in zip(outs, ref):
        assert torch.equal(got.tokens, want)
    assert not batch.stats.fallbacks, batch.stats.fallbacks
    assert batch.stats.stacked_steps > 0 and batch.stats.as_dict()["requests_per_stacked_step"] >= 2


def test_requests_join_and_leave_at_step_boundaries():
    model = random_model("llada")
    eng = _engine(model)
    cases = CASES["llada"]
    ref = [_alone(eng, p, **o) for p, o in cases]
    batch = Batch(eng)
    runs = [eng.start(eng.request(p, **o)) for p, o in cases]
    batch.add(runs[0])
    batch.add(runs[1])
    ended = []
    for i in range(40):
        if i == 3:
            batch.add(runs[2])                    # joins mid-way
        if i == 5:
            batch.add(runs[3])
        ended += batch.step()
        if not batch.runs:
            break
    assert all(err is None for _, err in ended) and len(ended) == 4
    for run, want in zip(runs, ref):
        run.close()
        assert torch.equal(run.result().tokens, want)


def test_a_cancelled_request_leaves_the_batch_and_the_others_finish():
    model = random_model("llada")
    eng = _engine(model)
    (p0, o0), (p1, o1) = CASES["llada"][:2]
    want = _alone(eng, p1, **o1)
    stop = [False]
    batch = Batch(eng)
    batch.add(eng.start(eng.request(p0, **o0), cancelled=lambda: stop[0]))
    keep = eng.start(eng.request(p1, **o1))
    batch.add(keep)
    batch.step()
    stop[0] = True
    ended = []
    while batch.runs:
        ended += batch.step()
    errors = [type(e).__name__ for _, e in ended if e is not None]
    assert errors == ["RequestCancelled"]
    keep.close()
    assert torch.equal(keep.result().tokens, want)


def test_a_newcomer_joins_only_if_the_stacked_step_fits_the_budget():
    model = random_model("llada")
    fixed = model.weight_bytes() + 320 * 2**20
    eng = _engine(model, memory_budget=fixed + 2 * 2**20)
    gen = eng.generation_config(max_new_tokens=8, steps=8)
    n = eng.capacity(gen)                                   # the longest request that fits alone
    prompt = [3 + i % 30 for i in range(n - 8)]
    batch = Batch(eng)
    first = eng.start(eng.request(prompt, max_new_tokens=8, steps=8))
    assert batch.fits(first)                                # an empty batch takes what admission took
    batch.add(first)
    newcomer = eng.start(eng.request(prompt, max_new_tokens=8, steps=8))     # admitted alone
    assert not batch.fits(newcomer)                         # two of them at once do not fit
    assert len(batch) == 1                                  # it waits; the running request goes on


FAST = {
    "llada": [([3, 4, 5, 6], dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.9)),
              ([7, 8, 9, 10, 11, 12, 13], dict(max_new_tokens=8, steps=8, block_length=4, cache="dual",
                                                threshold=0.9)),
              ([5, 6], dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.5)),
              ([9, 10, 11], dict(max_new_tokens=8, steps=8, block_length=4, cache="prefix", threshold=0.9))],
    "dream": [([3, 4, 5, 6], dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.9)),
              ([7, 8, 9, 10, 11, 12, 13], dict(max_new_tokens=8, steps=8, block_length=4, cache="dual",
                                                threshold=0.9))],
}


@pytest.mark.parametrize("family", sorted(FAST))
def test_block_cache_requests_stack_their_block_steps_and_keep_their_tokens(family, monkeypatch):
    model = random_model(family)
    eng = _engine(model)
    entries = _count_batched_attention(monkeypatch)
    ref = [_alone(eng, p, **o) for p, o in FAST[family]]
    batch = Batch(eng)
    runs = [eng.start(eng.request(p, **o)) for p, o in FAST[family]]
    batch.add(runs[0])
    for i, run in enumerate(runs[1:]):
        for _ in range(i + 1):               # later requests join at later step boundaries
            batch.step()
        batch.add(run)
    ended = []
    while batch.runs:
        ended += batch.step()
    assert all(err is None for _, err in ended) and not batch.stats.fallbacks, batch.stats.fallbacks
    for run, want in zip(runs, ref):
        run.close()
        assert torch.equal(run.result().tokens, want)
    assert batch.stats.stacked_steps > 0          # block steps of different requests ran together
    assert max(entries) >= 2                      # ... in one attention call over the paged pool
    assert eng.executor.kv_pool.allocated_pages == 0      # every store's pages came back


def _count_batched_attention(monkeypatch) -> list[int]:
    """Entries per batched attention call (kernels/varlen.py), recorded as the engine runs."""
    from mosaic.kernels import varlen as VL
    seen, real = [], VL.attention_into

    def spy(out, q, k, v, ent, kernel="loop", attend=None):
        seen.append(ent.num_entries)
        return real(out, q, k, v, ent, kernel, attend)
    monkeypatch.setattr(VL, "attention_into", spy)
    return seen


MIXED = [([3, 4, 5, 6, 7, 8, 9, 10, 11], dict(cache="dual", threshold=0.9, temperature=0.7, seed=5)),
         ([7, 8], dict(cache="dual", threshold=0.5)),
         ([5, 6, 7, 8, 9], dict(cache="dual", factor=1.0)),
         ([9, 10, 11, 12], dict(cache="prefix", threshold=0.9)),
         ([12, 11, 10, 9], dict(cache="prefix", threshold=0.7))]


def test_requests_of_different_options_and_lengths_share_the_batched_step(monkeypatch):
    """Thresholds, factors, sampling temperature and prompt lengths differ; the dual-cache block steps still
    run as one step (one attention call over the pool), the prefix ones of equal rows as another,
    and every request gets its tokens alone, joining and leaving at different rounds."""
    model = random_model("llada")
    eng = _engine(model)
    opts = dict(max_new_tokens=12, steps=12, block_length=4)
    ref = [_alone(eng, p, **opts, **o) for p, o in MIXED]
    entries = _count_batched_attention(monkeypatch)
    batch = Batch(eng)
    runs = [eng.start(eng.request(p, **opts, **o)) for p, o in MIXED]
    ended, joined = [], 0
    for i in range(200):
        if joined < len(runs) and i % 2 == 0:
            batch.add(runs[joined])
            joined += 1
        ended += batch.step()
        if not batch.runs and joined == len(runs):
            break
    assert all(err is None for _, err in ended) and not batch.stats.fallbacks, batch.stats.fallbacks
    for run, want in zip(runs, ref):
        run.close()
        assert torch.equal(run.result().tokens, want)
    assert max(entries) >= 3 and eng.executor.kv_pool.allocated_pages == 0


def test_a_batched_kernel_that_rounds_differently_is_named_in_lossy(monkeypatch):
    """The loop (the CPU's kernel) gives each sequence its values alone: no label. A varlen kernel
    (gather here, flash on a GPU) labels every request whose block steps it ran, and only those."""
    model = random_model("llada")
    eng = _engine(model)
    opts = dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.9)
    batch = Batch(eng)
    for p in ([3, 4, 5, 6], [7, 8, 9]):
        batch.add(eng.start(eng.request(p, **opts)))
    assert not any("batched attention" in lab for g in batch.run_all() for lab in g.lossy)
    monkeypatch.setenv("MOSAIC_VARLEN", "gather")
    batch = Batch(eng)
    for p in ([3, 4, 5, 6], [7, 8, 9]):
        batch.add(eng.start(eng.request(p, **opts)))
    for g in batch.run_all():
        assert any("batched attention (gather varlen" in lab for lab in g.lossy), g.lossy
    assert not any("batched attention" in lab for lab in eng.generate([3, 4, 5, 6], **opts).lossy)
