"""mosaic.compat_fast: Fast-dLLM's published call signatures give the published functions'
tokens and NFE (the oracle: tests/plain_fast.py, the published loops and cached forward written
out plainly), with the published defaults."""

import pytest
import torch
from conftest import random_model
from plain_fast import PlainLM, dream_block_generate, llada_generate

from mosaic import InputError, MosaicEngine
from mosaic.compat_fast import diffusion_generate, generate, generate_with_dual_cache, generate_with_prefix_cache

FUNCTIONS = {"none": generate, "prefix": generate_with_prefix_cache, "dual": generate_with_dual_cache}


def engine(fam):
    return MosaicEngine(random_model(fam), {"progress": False})


def prompt(cfg, n=6, batch=1, seed=7):
    return torch.randint(0, cfg.mask_id - 4, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("rule", [dict(threshold=0.2), dict(factor=1.0), dict()], ids=["threshold", "factor", "counts"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_llada_functions_equal_the_published(cache, rule, temperature):
    eng = engine("llada")
    p = prompt(eng.model.cfg, batch=2 if temperature == 0 else 1)
    kw = dict(steps=8, gen_length=8, block_length=4, temperature=temperature, **rule)
    ref, ref_nfe = llada_generate(PlainLM(eng.model), p, g=torch.Generator().manual_seed(3), cache=cache, **kw)
    torch.manual_seed(3)
    calls = []
    x, nfe = FUNCTIONS[cache](eng, p, mask_id=eng.model.cfg.mask_id, step_callback=calls.append, **kw)
    assert torch.equal(x, ref) and nfe == ref_nfe and calls == list(range(nfe))


@pytest.mark.slow
def test_llada_defaults_are_the_published_ones():
    eng = engine("llada")
    p = prompt(eng.model.cfg)
    ref, ref_nfe = llada_generate(PlainLM(eng.model), p, 128, 128, 128, cache="dual")
    x, nfe = generate_with_dual_cache(eng, p, mask_id=eng.model.cfg.mask_id)
    assert torch.equal(x, ref) and nfe == ref_nfe and x.shape == (1, 6 + 128)


@pytest.mark.parametrize("dual", [False, True])
@pytest.mark.parametrize("alg", ["confidence_threshold", "entropy"])
def test_dream_cached_method_equals_the_published(dual, alg):
    eng = engine("dream")
    p = prompt(eng.model.cfg)
    threshold = 0.3 if alg == "confidence_threshold" else None
    ref, _ = dream_block_generate(PlainLM(eng.model), p, 8, 8, 4, threshold=threshold, dual=dual)
    out = diffusion_generate(eng, p, max_new_tokens=8, steps=8, temperature=0.0, alg=alg, threshold=0.3,
                             block_length=4, dual_cache=dual)
    assert torch.equal(out, ref)


def test_dream_cached_method_defaults():
    """block_length 32 and threshold 0.9 by default; temperature inherited as the official call does."""
    eng = engine("dream")
    p = prompt(eng.model.cfg)
    ref, _ = dream_block_generate(PlainLM(eng.model), p, 32, 32, 32, threshold=0.9)
    out = diffusion_generate(eng, p, max_new_tokens=32, steps=32, temperature=0.0, alg="confidence_threshold")
    assert torch.equal(out, ref)


def test_refusals():
    with pytest.raises(InputError, match="LLaDA's"):
        generate(engine("dream"), torch.tensor([[1, 2]]), mask_id=40)
    with pytest.raises(InputError, match="mask_id=126336"):
        generate(engine("llada"), torch.tensor([[1, 2]]))
    with pytest.raises(InputError, match="unknown diffusion_generate options"):
        diffusion_generate(engine("dream"), torch.tensor([[1, 2]]), colour="red")
