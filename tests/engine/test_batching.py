"""Continuous batching through the Scheduler (engine/scheduler.py) and its round executor
(engine/batching.py): requests of different lengths, joining at step boundaries, stacked into
one planned step, get exactly their tokens alone (CPU, float32); so does generate() with a list
of prompts, which is a batch of requests."""

import pytest
import torch
from conftest import random_model

from mosaic import MosaicEngine
from mosaic.engine import RequestCancelled
from mosaic.engine.scheduler import Scheduler


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
    sched = Scheduler(eng)
    runs = [eng.start(eng.request(p, **o)) for p, o in CASES[family]]
    for run in runs:
        sched.add(run)
    outs = sched.run_all()
    assert all(f.error is None for f in outs)
    got = {id(f.run): f.generation.tokens for f in outs}
    for run, want in zip(runs, ref):
        assert torch.equal(got[id(run)], want)
    assert not sched.stats.fallbacks, sched.stats.fallbacks
    assert sched.stats.stacked_steps > 0 and sched.stats.as_dict()["requests_per_stacked_step"] >= 2


@pytest.mark.parametrize("family", sorted(CASES))
def test_a_list_of_prompts_is_a_batch_of_requests_with_their_tokens_alone(family):
    eng = _engine(random_model(family))
    prompts = [p for p, _ in CASES[family]]
    opts = CASES[family][0][1]
    out = eng.generate(prompts, **opts)
    alone = [eng.generate(p, **opts) for p in prompts]
    assert torch.equal(out.tokens, torch.cat([a.tokens for a in alone]))
    assert [p.texts for p in out.parts] == [a.texts for a in alone] and out.steps == alone[0].steps


def test_requests_join_and_leave_at_step_boundaries():
    model = random_model("llada")
    eng = _engine(model)
    cases = CASES["llada"]
    ref = [_alone(eng, p, **o) for p, o in cases]
    sched = Scheduler(eng)
    runs = [eng.start(eng.request(p, **o)) for p, o in cases]
    sched.add(runs[0])
    sched.add(runs[1])
    ended = []
    for i in range(40):
        if i == 3:
            sched.add(runs[2])                    # joins mid-way
        if i == 5:
            sched.add(runs[3])
        ended += sched.step()
        if not sched.has_work:
            break
    assert all(f.error is None for f in ended) and len(ended) == 4
    for run, want in zip(runs, ref):
        assert torch.equal(run.result().tokens, want)


def test_a_cancelled_request_leaves_the_batch_and_the_others_finish():
    model = random_model("llada")
    eng = _engine(model)
    (p0, o0), (p1, o1) = CASES["llada"][:2]
    want = _alone(eng, p1, **o1)
    sched = Scheduler(eng)
    gone = eng.start(eng.request(p0, **o0))
    keep = eng.start(eng.request(p1, **o1))
    sched.add(gone)
    sched.add(keep)
    sched.step()
    sched.cancel(gone)
    ended = sched.run_all()
    errors = [type(f.error).__name__ for f in ended if f.error is not None]
    assert errors == ["RequestCancelled"] and gone.steps_done == 1
    assert torch.equal(keep.result().tokens, want)


def test_a_callers_cancelled_flag_is_the_same_path():
    eng = _engine(random_model("llada"))
    p0, o0 = CASES["llada"][0]
    stop = [False]
    run = eng.start(eng.request(p0, **o0), cancelled=lambda: stop[0])
    sched = Scheduler(eng)
    sched.add(run)
    sched.step()
    stop[0] = True
    (f,) = sched.run_all()
    assert isinstance(f.error, RequestCancelled) and run.is_cancelled()


def test_a_newcomer_joins_only_if_the_stacked_step_fits_the_budget():
    model = random_model("llada")
    fixed = model.weight_bytes() + 320 * 2**20
    eng = _engine(model, memory_budget=fixed + 2 * 2**20)
    gen = eng.generation_config(max_new_tokens=8, steps=8)
    n = eng.capacity(gen)                                   # the longest request that fits alone
    prompt = [3 + i % 30 for i in range(n - 8)]
    sched = Scheduler(eng)
    first = eng.start(eng.request(prompt, max_new_tokens=8, steps=8))
    assert sched.fits(first)                                # an empty batch takes what admission took
    sched.add(first)
    newcomer = eng.start(eng.request(prompt, max_new_tokens=8, steps=8))     # admitted alone
    sched.add(newcomer)
    sched.step()
    assert sched.running == [first] and list(sched.waiting) == [newcomer]   # two at once do not fit: it waits
    assert not sched.fits(newcomer)
    ended = sched.run_all()                                 # it runs once the first left
    assert [f.run for f in ended] == [first, newcomer] and all(f.error is None for f in ended)


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
    sched = Scheduler(eng)
    runs = [eng.start(eng.request(p, **o)) for p, o in FAST[family]]
    sched.add(runs[0])
    for i, run in enumerate(runs[1:]):
        for _ in range(i + 1):               # later requests join at later step boundaries
            sched.step()
        sched.add(run)
    ended = sched.run_all()
    assert all(f.error is None for f in ended) and not sched.stats.fallbacks, sched.stats.fallbacks
    for run, want in zip(runs, ref):
        assert torch.equal(run.result().tokens, want)
    assert sched.stats.stacked_steps > 0          # block steps of different requests ran together
    assert max(entries) >= 2                      # ... in one attention call over the paged pool
    assert eng.executor.kv_pool.allocated_pages == 0      # every store's pages came back


@pytest.mark.parametrize("family", sorted(FAST))
def test_fills_of_one_length_stack_and_keep_their_tokens(family):
    """A fill is the block step of every row: requests of one length that start together run
    their first forward as one stacked step."""
    eng = _engine(random_model(family))
    opts = FAST[family][0][1]
    prompts = [[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]]
    ref = [_alone(eng, p, **opts) for p in prompts]
    sched = Scheduler(eng)
    runs = [eng.start(eng.request(p, **opts)) for p in prompts]
    for run in runs:
        sched.add(run)
    sched.step()
    assert sched.stats.stacked_steps == 1 and sched.stats.steps == 1     # three fills, one step
    assert all(f.error is None for f in sched.run_all())
    for run, want in zip(runs, ref):
        assert torch.equal(run.result().tokens, want)


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
    sched = Scheduler(eng)
    runs = [eng.start(eng.request(p, **opts, **o)) for p, o in MIXED]
    ended, joined = [], 0
    for i in range(200):
        if joined < len(runs) and i % 2 == 0:
            sched.add(runs[joined])
            joined += 1
        ended += sched.step()
        if not sched.has_work and joined == len(runs):
            break
    assert all(f.error is None for f in ended) and not sched.stats.fallbacks, sched.stats.fallbacks
    for run, want in zip(runs, ref):
        assert torch.equal(run.result().tokens, want)
    assert max(entries) >= 3 and eng.executor.kv_pool.allocated_pages == 0


def test_a_batched_kernel_that_rounds_differently_is_named_in_lossy():
    """The loop (the CPU's kernel) gives each sequence its values alone: no label. A varlen kernel
    (gather here, flash on a GPU) labels every request whose block steps it ran, and only those."""
    model = random_model("llada")
    eng = _engine(model)
    opts = dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.9)
    assert not any("batched attention" in lab for lab in eng.generate([[3, 4, 5, 6], [7, 8, 9]], **opts).lossy)
    eng = _engine(model, varlen_kernel="gather")
    for g in eng.generate([[3, 4, 5, 6], [7, 8, 9]], **opts).parts:
        assert any("batched attention (gather varlen" in lab for lab in g.lossy), g.lossy
    assert not any("batched attention" in lab for lab in eng.generate([3, 4, 5, 6], **opts).lossy)


@pytest.mark.slow      # ~50 s: every block step's attention under the Triton interpreter
def test_batch_invariant_mode_with_the_triton_varlen_kernel_gives_the_tokens_alone(monkeypatch):
    """batch_invariant on CUDA runs block steps, alone and batched, through the Triton varlen
    kernel (here under the interpreter): each request's tokens in the batch are its tokens alone,
    and nothing is labelled."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    eng = _engine(random_model("llada"), batch_invariant=True, varlen_kernel="triton")
    entries = _count_batched_attention(monkeypatch)
    cases = FAST["llada"][:3]
    alone = [eng.generate(p, **o) for p, o in cases]
    assert entries and min(entries) == 1                   # alone: one entry, the same kernel
    sched = Scheduler(eng)
    runs = [eng.start(eng.request(p, **o)) for p, o in cases]
    for run in runs:
        sched.add(run)
    assert all(f.error is None for f in sched.run_all())
    for run, want in zip(runs, alone):
        got = run.result()
        assert torch.equal(got.tokens, want.tokens) and not any("batched" in lab for lab in got.lossy)
    assert max(entries) >= 2 and not sched.stats.fallbacks


def test_a_nan_step_fails_its_own_request_not_its_round_mates(monkeypatch):
    """Two requests that run alone in one round (cfg runs alone) leave their steps' NaN tests on
    the device (published.defer_check) until each reads back its commit: the poisoned request
    fails with NumericsError and the other one gets its tokens alone (the first readback of the
    round used to read, and raise for, both tests, and the poisoned one committed NaN draws)."""
    import mosaic.engine.steps as steps_mod
    from mosaic.errors import NumericsError

    eng = _engine(random_model("llada"))
    opts = dict(max_new_tokens=4, steps=4)
    want = _alone(eng, [3, 4, 5, 6], **opts)
    runs = [eng.start(eng.request([3, 4, 5, 6], **opts)), eng.start(eng.request([7, 8, 9], cfg_scale=1.0, **opts))]
    poison = {"on": False}
    real_check, real_execute = steps_mod.defer_check, eng.executor.execute

    def defer_check(conf, dtype):
        real_check(torch.full_like(conf, float("nan")) if poison["on"] else conf, dtype)

    def execute(step, state):
        poison["on"] = state is runs[1].state
        return real_execute(step, state)

    monkeypatch.setattr(steps_mod, "defer_check", defer_check)
    monkeypatch.setattr(eng.executor, "execute", execute)
    sched = Scheduler(eng)
    for run in runs:
        sched.add(run)
    ended = {id(f.run): f for f in sched.run_all()}
    assert ended[id(runs[0])].error is None and torch.equal(ended[id(runs[0])].generation.tokens, want)
    assert isinstance(ended[id(runs[1])].error, NumericsError)
