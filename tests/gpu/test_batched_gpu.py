"""Batched block steps on the GPU: the varlen kernels against the
per-sequence loop, a request's tokens in a batched step equal its tokens alone in
batch-invariant mode (dual and prefix caches, mixed lengths, greedy and seeded), captured
bucketed steps give the same padded steps' eager tokens, and the default mode's batched tokens
are labelled (how many rows differ from alone is printed: a measurement, not a pass mark).
Skipped without CUDA.

    python -m pytest -q -s -m gpu tests/gpu/test_batched_gpu.py"""

import pytest
import torch
from conftest import left_padded, needs_cuda

from mosaic import MosaicEngine, kernels, load
from mosaic.kernels import varlen as VL

pytestmark = [pytest.mark.gpu, needs_cuda]

INV = {"progress": False, "batch_invariant": True}
LENGTHS = (30, 300, 7, 90, 129)


def _prompts(vocab, lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kernel", ["flash", "efficient", "gather", "triton"])
@pytest.mark.parametrize("heads", [(32, 32), (28, 4)])
def test_the_varlen_kernels_agree_with_the_loop(kernel, heads):
    hq, hkv = heads
    if not kernels.varlen_available(kernel, "cuda", torch.bfloat16, hq, hkv, 128):
        pytest.skip(f"{kernel} does not take {hq}/{hkv} heads here")
    g = torch.Generator(device="cuda").manual_seed(0)
    starts, counts = [5, 3000, 1200, 7000, 4500], [1100, 1300, 1057, 1568, 32]
    k = torch.randn(9000, hkv, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(9000, hkv, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    q = torch.randn(5 * 32, hq, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    ent = VL.entries([32] * 5, starts, counts, "cuda", max_k=2048)
    want, got = torch.empty(160, hq * 128, device="cuda", dtype=torch.bfloat16), None
    VL.attention_into(want, q, k, v, ent, "loop")
    got = torch.empty_like(want)
    VL.attention_into(got, q, k, v, ent, kernel)
    err = float((got.float() - want.float()).norm() / want.float().norm())
    print(f"{kernel} {hq}/{hkv} heads: relative error vs the loop {err:.2e}")
    assert err < 1e-2
    # an entry's values do not depend on the entries beside it (no split over keys)
    alone = torch.empty(32, hq * 128, device="cuda", dtype=torch.bfloat16)
    VL.attention_into(alone, q[64:96], k, v, VL.entries([32], [1200], [1057], "cuda", max_k=2048), kernel)
    print(f"{kernel}: an entry alone equals it among others: {torch.equal(alone, got[64:96])}")
    if kernel == "triton":                         # batch-invariant mode's kernel: bit for bit
        assert torch.equal(alone, got[64:96])


def _cases():
    return [("llada-8b-2l", load("llada-8b", device="cuda", num_layers=2)),
            ("dream-7b-2l", load("dream-7b", device="cuda", num_layers=2))]


OPTS = [dict(max_new_tokens=64, steps=64, block_length=32, cache="dual", threshold=0.9),
        dict(max_new_tokens=64, steps=64, block_length=32, cache="prefix", threshold=0.9),
        dict(max_new_tokens=64, steps=64, block_length=32, cache="dual", threshold=0.9, temperature=0.7, seed=3)]


def _stacked(eng, prompts, opts):
    """Each prompt its own request, all in one Scheduler (stacked block steps); their Generations."""
    from mosaic.engine.scheduler import Scheduler
    sched = Scheduler(eng)
    runs = [eng.start(eng.request(p, **opts)) for p in prompts]
    for run in runs:
        sched.add(run)
    assert all(f.error is None for f in sched.run_all())
    assert sched.stats.stacked_steps > 0 and not sched.stats.fallbacks, sched.stats.fallbacks
    return [run.result() for run in runs]


@pytest.mark.parametrize("case", range(2), ids=["llada-8b", "dream-7b"])
@pytest.mark.parametrize("opts", range(3), ids=["dual", "prefix", "dual-seeded"])
def test_batched_block_steps_equal_alone_in_batch_invariant_mode(case, opts):
    """Separate requests of mixed lengths stacked (every option); one request of several prompts
    (greedy: its random stream is one for all its rows)."""
    name, model = _cases()[case]
    o = OPTS[opts]
    eng = MosaicEngine(model, INV)
    vocab = min(eng.model.cfg.vocab, eng.model.cfg.mask_id) - 1
    prompts = _prompts(vocab)
    alone = [eng.generate(p, **o) for p in prompts]
    for i, got in enumerate(_stacked(eng, prompts, o)):
        assert torch.equal(got.tokens, alone[i].tokens), (name, opts, i)
        assert not any("batched attention" in lab for lab in got.lossy)
    if "temperature" not in o:
        inputs, mask = left_padded(eng.model.cfg, prompts)          # one left-padded request of B rows
        together = eng.generate(inputs=inputs, attention_mask=mask, **o)
        for i in range(len(prompts)):
            assert torch.equal(together.tokens[i], alone[i].tokens[0]), (name, opts, "one request", i)


def test_the_default_batched_step_is_labelled_and_its_agreement_printed():
    model = load("llada-8b", device="cuda", num_layers=2)
    eng = MosaicEngine(model, {"progress": False})
    prompts = _prompts(1000)
    o = OPTS[0]
    outs = _stacked(eng, prompts, o)
    same = sum(torch.equal(eng.generate(p, **o).tokens, g.tokens) for p, g in zip(prompts, outs))
    print(f"default mode, dual 0.9, {len(prompts)} requests of mixed lengths stacked: {same} of {len(prompts)} "
          f"equal alone; lossy: {outs[0].lossy}")
    assert all(any("batched attention (flash" in lab or "batched attention (efficient" in lab for lab in g.lossy)
               for g in outs)


def test_captured_bucketed_steps_give_the_same_padded_steps_eager_tokens():
    """Two engines pad the same way (graphs allowed in both), one never replays: the stacked block
    steps' tokens are equal, one graph per batch bucket serves many rounds."""
    model = load("llada-8b", device="cuda", num_layers=2)
    prompts = _prompts(1000)
    o = OPTS[0]

    def run(replay: bool):
        eng = MosaicEngine(model, {"progress": False})
        if not replay:                      # padded as the captured engine pads, every step eager
            eng.runner.graphs.run = lambda *a, **k: None
        return [g.tokens for g in _stacked(eng, prompts, o)], eng
    want, _ = run(False)
    got, eng = run(True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    pooled = {k: c for k, c in eng.graphs.graphs.items() if k[3] and k[3][0] == "pool"}
    print({k[1]: c.replays for k, c in pooled.items()}, eng.graphs.stats.as_dict())
    assert pooled and max(c.replays for c in pooled.values()) >= 3
