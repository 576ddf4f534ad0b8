"""Batch-invariant mode and self-speculative decoding on the GPU: in batch-invariant
mode a request's tokens are identical alone, in a left-padded batch with other lengths, in the
server's continuous batch, and under speculation (= step-by-step). Skipped without CUDA.

    python -m pytest -q -m gpu tests/gpu/test_batch_invariant_gpu.py"""

import pytest
import torch
from conftest import bundled, left_padded, needs_cuda

from mosaic import MosaicEngine, load
from mosaic.engine.scheduler import Scheduler
from mosaic.kernels import invariant_triton as T

pytestmark = [pytest.mark.gpu, needs_cuda]

INV = {"progress": False, "batch_invariant": True}


def _prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_invariant_gemm_is_row_invariant_on_the_gpu(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(4096, 4096, device="cuda", generator=g).to(dtype)
    x = torch.randn(3000, 4096, device="cuda", generator=g).to(dtype)
    full = torch.empty(3000, 4096, device="cuda", dtype=dtype)
    T.matmul(full, x, w)
    for m in (1, 3, 17, 129, 1000):
        part = torch.empty(m, 4096, device="cuda", dtype=dtype)
        T.matmul(part, x[7:7 + m], w)
        assert torch.equal(part, full[7:7 + m]), m
    ref = (x[:64].float() @ w.float().t())
    assert torch.allclose(full[:64].float(), ref, rtol=2e-2, atol=2e-1)


def _models():
    return [("tiny-llada", str(bundled("tiny-llada")), dict(max_new_tokens=8, steps=8)),
            ("tiny-dream", str(bundled("tiny-dream")), dict(max_new_tokens=8, steps=8)),
            ("llada-8b-2l", load("llada-8b", device="cuda", num_layers=2), dict(max_new_tokens=32, steps=32,
                                                                                block_length=16)),
            ("dream-7b-2l", load("dream-7b", device="cuda", num_layers=2), dict(max_new_tokens=32, steps=32,
                                                                                alg="entropy")),
            ("llada-moe-2l", load("llada-moe-7b", device="cuda", num_layers=2), dict(max_new_tokens=32, steps=32))]


@pytest.mark.parametrize("case", range(5), ids=["tiny-llada", "tiny-dream", "llada-8b", "dream-7b", "llada-moe"])
def test_tokens_alone_equal_tokens_in_a_padded_batch_of_mixed_lengths(case):
    """bf16 on the GPU: without batch_invariant the measured H200 case (8 x 1k prompts) changed a
    request's tokens in a batch; with it every row's tokens are its tokens alone."""
    name, model, opts = _models()[case]
    eng = MosaicEngine(model, INV)
    vocab = min(eng.model.cfg.vocab, eng.model.cfg.mask_id) - 1
    prompts = _prompts(vocab, (5, 37, 12, 200, 64, 9, 128, 3)) if "tiny" not in name else \
        ["sort 31415926=", "57+384=", "sort 907=", "12+9=", "sort 5555="]
    together = eng.generate(prompts, **opts).tokens              # a batch of requests (the Scheduler)
    ids = [p if isinstance(p, list) else eng.encode(p)[0] for p in prompts]
    inputs, mask = left_padded(eng.model.cfg, ids)
    padded = eng.generate(inputs=inputs, attention_mask=mask, **opts).tokens   # one padded request
    for i, p in enumerate(prompts):
        alone = eng.generate(p, **opts).tokens[0]
        assert torch.equal(alone, together[i]) and torch.equal(alone, padded[i]), (name, i)


@pytest.mark.parametrize("case", range(5), ids=["tiny-llada", "tiny-dream", "llada-8b", "dream-7b", "llada-moe"])
@pytest.mark.parametrize("k", [2, 4])
def test_speculative_equals_step_by_step_in_batch_invariant_mode(case, k):
    name, model, opts = _models()[case]
    eng = MosaicEngine(model, INV)
    vocab = min(eng.model.cfg.vocab, eng.model.cfg.mask_id) - 1
    prompts = _prompts(vocab, (40, 9, 100)) if "tiny" not in name else ["sort 31415926=", "57+384=", "sort 907="]
    for batch in ([prompts[0]], prompts):
        ref = eng.generate(batch, **opts)
        spec = eng.generate(batch, speculate=k, **opts)
        assert torch.equal(spec.tokens, ref.tokens), (name, len(batch))
        assert spec.lossy == [] and spec.stats["nfe"] <= ref.steps


def test_continuous_batching_is_exact_in_batch_invariant_mode():
    """The Scheduler stacks requests of mixed lengths and options (speculative or not) into one
    planned step; in batch-invariant mode each gets its tokens alone."""
    model = load("llada-8b", device="cuda", num_layers=2)
    eng = MosaicEngine(model, INV)
    ps = _prompts(1000, (30, 300, 7, 90))
    cases = [(ps[0], dict(max_new_tokens=32, steps=32, block_length=16)),
             (ps[1], dict(max_new_tokens=32, steps=32, block_length=16, speculate=4)),
             (ps[2], dict(max_new_tokens=16, steps=16)),
             (ps[3], dict(max_new_tokens=32, steps=16, block_length=32, speculate=2))]
    ref = [eng.generate(p, **{k: v for k, v in o.items() if k != "speculate"}).tokens for p, o in cases]
    sched = Scheduler(eng)
    runs = [eng.start(eng.request(p, **o)) for p, o in cases]
    for run in runs:
        sched.add(run)
    assert all(f.error is None for f in sched.run_all())
    for run, want in zip(runs, ref):
        assert torch.equal(run.result().tokens, want)
    assert sched.stats.stacked_steps > 0 and not sched.stats.fallbacks


@pytest.mark.parametrize("opts", [
    dict(max_new_tokens=32, steps=32, block_length=16),
    dict(max_new_tokens=32, steps=32, block_length=16, temperature=0.8, seed=5),
    dict(max_new_tokens=32, steps=32, block_length=16, cache="dual", threshold=0.9),
    dict(max_new_tokens=32, steps=32, block_length=16, cache="dual", threshold=0.9, temperature=0.8, seed=5),
], ids=["exact", "exact-sampled", "dual", "dual-sampled"])
def test_a_list_of_prompts_gets_its_tokens_alone_in_batch_invariant_mode(opts):
    """100% of rows identical alone vs batched (a list is a batch of requests, stacked by the
    Scheduler), greedy and seeded sampling, mixed lengths, exact and dual: the batching target."""
    eng = MosaicEngine(load("llada-8b", device="cuda", num_layers=2), INV)
    ps = _prompts(1000, (30, 300, 7, 90, 64, 129))
    together = eng.generate(ps, **opts)
    alone = [eng.generate(p, **opts).tokens[0] for p in ps]
    same = [bool(torch.equal(a, t)) for a, t in zip(alone, together.tokens)]
    assert all(same), same


def test_speculation_without_batch_invariant_is_labelled_on_the_gpu():
    eng = MosaicEngine(str(bundled("tiny-llada")), {"progress": False, "device": "cuda"})
    out = eng.generate("sort 907=", max_new_tokens=8, steps=8, speculate=2)
    assert any("batch_invariant" in label for label in out.lossy)
