"""The planned path (one arena, mask-only logits) gives the native path's tokens exactly."""

import pytest
import torch
from conftest import bundled, random_model

from mosaic import MosaicEngine, load

LLADA_CASES = [
    dict(max_new_tokens=12, steps=12),
    dict(max_new_tokens=12, steps=6, block_length=4),
    dict(max_new_tokens=8, steps=8, remasking="random", seed=3),
    dict(max_new_tokens=8, steps=4, temperature=0.7, seed=4),
    dict(max_new_tokens=8, steps=8, temperature=0.5, remasking="random", seed=5),
    dict(max_new_tokens=8, steps=8, cfg_scale=1.5),
    dict(max_new_tokens=8, steps=4, confidence_dtype="float64"),
    dict(max_new_tokens=8, steps=8, logits_eos_inf=True, confidence_eos_eot_inf=True),
    dict(max_new_tokens=8, steps=8, confidence_eos_eot_inf=True, temperature=0.3, seed=6),
]
DREAM_CASES = [
    dict(max_new_tokens=10, steps=10, alg="maskgit_plus"),
    dict(max_new_tokens=10, steps=5, alg="topk_margin"),
    dict(max_new_tokens=10, steps=10, alg="entropy"),
    dict(max_new_tokens=10, steps=10, alg="origin", seed=1),
    dict(max_new_tokens=10, steps=6, alg="origin", temperature=0.8, seed=2),
    dict(max_new_tokens=10, steps=5, alg="entropy", temperature=0.6, top_p=0.9, seed=3),
    dict(max_new_tokens=10, steps=5, alg="maskgit_plus", temperature=0.6, top_k=7, seed=4),
    dict(max_new_tokens=10, steps=5, alg="maskgit_plus", alg_temp=0.5, seed=5),
]


def prompts(cfg, batch):
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(batch):
        n = 5 + 3 * i  # different lengths: left padding when batch > 1
        out.append(torch.randint(0, cfg.mask_id - 4, (n,), generator=g).tolist())
    return out if batch > 1 else out[0]


def both(engine, prompt, **kw):
    a = engine.generate(prompt, native=True, **kw)
    b = engine.generate(prompt, native=False, **kw)
    return a.tokens, b.tokens


@pytest.mark.parametrize("case", LLADA_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("fam", ["llada", "llada_moe"])
@pytest.mark.parametrize("batch", [1, 2])
def test_llada_sampler_planned_equals_native(fam, case, batch):
    # LLaDA-MoE configs have no end-of-turn id (refused without one: tests/test_inputs.py)
    eot = {"eot_id": 39} if fam == "llada_moe" and case.get("confidence_eos_eot_inf") else {}
    model = random_model(fam, **eot)
    engine = MosaicEngine(model, {"sanitize": True, "progress": False})
    nat, plan = both(engine, prompts(model.cfg, batch), **case)
    assert torch.equal(nat, plan)


@pytest.mark.parametrize("case", DREAM_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("batch", [1, 2])
def test_dream_sampler_planned_equals_native(case, batch):
    model = random_model("dream")
    engine = MosaicEngine(model, {"sanitize": True, "progress": False})
    nat, plan = both(engine, prompts(model.cfg, batch), **case)
    assert torch.equal(nat, plan)


@pytest.mark.parametrize("chunks", [(1, 1, 1), (3, 2, 4), (8, 8, 8), (2, 5, 1)])
def test_chunked_planned_equals_native(family, chunks):
    model = random_model(family)
    engine = MosaicEngine(model, {"sanitize": True, "progress": False, "chunks": chunks})
    kw = dict(max_new_tokens=10, steps=5) if family != "dream" else dict(max_new_tokens=10, steps=5, alg="entropy")
    nat, plan = both(engine, prompts(model.cfg, 2), **kw)
    assert torch.equal(nat, plan)


def test_bundled_model_planned_equals_native():
    model = load(bundled("tiny-llada"))
    engine = MosaicEngine(model, {"sanitize": True, "progress": False})
    batch = ["sort 31415926=", "57+384=", "sort 907=", "123+456="]
    nat = engine.generate(batch, native=True)  # left-padded: positions count the pads
    plan = engine.generate(batch)
    assert torch.equal(nat.tokens, plan.tokens)
    # one prompt length per batch, as trained (no padding): held-out prompts answered right
    from mosaic.assets import tasks
    held = tasks.held_out(per_shape=6)
    right = 0
    for n in sorted({len(p) for p in held}):
        group = [p for p in held if len(p) == n]
        right += sum(t == tasks.solve(p) for p, t in zip(group, engine.generate(group).texts))
    assert right / len(held) >= 0.9


def test_bundled_dream_planned_equals_native():
    model = load(bundled("tiny-dream"))
    engine = MosaicEngine(model, {"sanitize": True, "progress": False})
    batch = ["sort 52830=", "88+99="]
    for alg in ("maskgit_plus", "topk_margin", "entropy", "origin"):
        nat = engine.generate(batch, native=True, alg=alg, seed=0)
        plan = engine.generate(batch, alg=alg, seed=0)
        assert torch.equal(nat.tokens, plan.tokens), alg


KERNEL_CASES = [("llada", dict(max_new_tokens=8, steps=8)),
                ("llada", dict(max_new_tokens=8, steps=4, remasking="random", seed=2)),
                ("llada_moe", dict(max_new_tokens=8, steps=8, block_length=4)),
                ("dream", dict(max_new_tokens=8, steps=8, alg="maskgit_plus")),
                ("dream", dict(max_new_tokens=8, steps=4, alg="topk_margin")),
                ("dream", dict(max_new_tokens=8, steps=8, alg="entropy"))]


@pytest.mark.parametrize("fam, case", KERNEL_CASES)
def test_fused_kernel_keeps_tokens(fam, case):
    """The Triton masked-logits kernel (interpreted on the CPU) gives the native tokens."""
    from mosaic.kernels import interpret
    if not interpret() and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 or CUDA")
    model = random_model(fam)
    engine = MosaicEngine(model, {"sanitize": True, "progress": False, "logits_kernel": "triton"})
    nat, plan = both(engine, prompts(model.cfg, 2), **case)
    assert torch.equal(nat, plan)
    assert any(s.fused for s in engine.history)  # the fused path did run


def test_bundled_model_with_the_fused_kernel():
    from mosaic.kernels import interpret
    if not interpret() and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 or CUDA")
    engine = MosaicEngine(load(bundled("tiny-llada")), {"progress": False, "logits_kernel": "triton"})
    batch = ["sort 31415926=", "57+384=", "sort 907=", "123+456="]
    assert torch.equal(engine.generate(batch, native=True).tokens, engine.generate(batch).tokens)
