"""mosaic.compat gives the official functions' results: same arguments, same seeds, same tokens.

The oracle is tests/official.py (the published loops written out plainly) driven by Mosaic's
native forward, so a difference can only come from the calling convention or the sampler."""

import pytest
import torch
from conftest import random_model
from official import dream_generate, llada_generate

from mosaic import InputError, MosaicEngine
from mosaic.compat import DreamModel, DreamOutput, diffusion_generate, generate


def engine(fam, **changes):
    return MosaicEngine(random_model(fam, **changes), {"progress": False})


def net(eng):
    return lambda ids, mask: eng.forward_logits(ids, mask)


def padded_batch(cfg, lengths=(5, 9, 7), seed=3):
    """[B, P] left-padded prompt ids (padding holds the pad id, as a tokenizer writes it) and mask."""
    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    ids = torch.full((len(lengths), P), cfg.pad_id, dtype=torch.long)
    mask = torch.zeros(len(lengths), P, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, P - n:] = torch.randint(0, cfg.mask_id - 4, (n,), generator=g)
        mask[i, P - n:] = 1
    return ids, mask


LLADA_CASES = [
    dict(steps=8, gen_length=8, block_length=8),
    dict(steps=8, gen_length=8, block_length=4),
    dict(steps=4, gen_length=8, block_length=8, cfg_scale=1.5),
    dict(steps=8, gen_length=8, block_length=8, temperature=0.8),
    dict(steps=8, gen_length=8, block_length=4, temperature=0.5, remasking="random"),
    dict(steps=8, gen_length=8, block_length=8, logits_eos_inf=True, confidence_eos_eot_inf=True),
]


@pytest.mark.parametrize("case", LLADA_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("fam", ["llada", "llada_moe"])
@pytest.mark.parametrize("padded", [False, True])
def test_llada_generate_matches_official(fam, case, padded):
    eng = engine(fam, eot_id=30)
    cfg = eng.model.cfg
    ids, mask = padded_batch(cfg) if padded else (padded_batch(cfg, (6,))[0], None)
    ids_kw = dict(mask_id=cfg.mask_id, **case)
    torch.manual_seed(11)
    ref = llada_generate(net(eng), ids, mask, eos_id=cfg.eos_id, eot_id=cfg.eot_id, **ids_kw)
    torch.manual_seed(11)
    ours = generate(eng, ids, mask, **ids_kw)
    assert ours.shape == (ids.shape[0], ids.shape[1] + case["gen_length"])
    assert torch.equal(ours, ref)
    assert torch.equal(ours[:, :ids.shape[1]], ids)     # the caller's padding comes back as given


DREAM_CASES = [
    dict(max_new_tokens=10, steps=10, alg="maskgit_plus"),
    dict(max_new_tokens=10, steps=5, alg="entropy"),
    dict(max_new_tokens=10, steps=5, alg="topk_margin"),
    dict(max_new_tokens=10, steps=6, alg="origin", temperature=0.8),
    dict(max_new_tokens=10, steps=5, alg="entropy", temperature=0.6, top_p=0.9),
    dict(max_new_tokens=10, steps=5, alg="maskgit_plus", temperature=0.6, top_k=7),
    dict(max_new_tokens=10, steps=5, alg="maskgit_plus", alg_temp=0.5),
    dict(max_length=20, steps=4, alg="entropy"),
]


@pytest.mark.parametrize("case", DREAM_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("padded", [False, True])
def test_dream_diffusion_generate_matches_official(case, padded):
    eng = engine("dream")
    cfg = eng.model.cfg
    ids, mask = padded_batch(cfg) if padded else (padded_batch(cfg, (6,))[0], None)
    torch.manual_seed(5)
    ref = dream_generate(net(eng), ids, mask, mask_token_id=cfg.mask_id, **case)
    torch.manual_seed(5)
    ours = diffusion_generate(eng, ids, attention_mask=mask, **case)
    assert torch.equal(ours, ref)


def test_dream_defaults_without_a_generation_config():
    """No options: DreamGenerationConfig's defaults (20 new tokens, 512 steps, alg 'origin');
    generation_config.json is not read, as the official method does not read it."""
    eng = engine("dream")
    eng.model.generation_defaults = {"steps": 3, "alg": "entropy", "max_new_tokens": 4}  # ignored
    ids, _ = padded_batch(eng.model.cfg, (6,))
    torch.manual_seed(2)
    ref = dream_generate(net(eng), ids, mask_token_id=eng.model.cfg.mask_id,
                         max_position_embeddings=eng.model.cfg.max_seq_len)
    torch.manual_seed(2)
    ours = diffusion_generate(eng, ids)
    assert ours.shape == (1, 26) and torch.equal(ours, ref)


def test_dream_model_method_dict_and_history():
    eng = engine("dream")
    ids, mask = padded_batch(eng.model.cfg)
    kw = dict(max_new_tokens=6, steps=3, alg="entropy", temperature=0.5)
    torch.manual_seed(9)
    ref, ref_hist = dream_generate(net(eng), ids, mask, mask_token_id=eng.model.cfg.mask_id,
                                   return_history=True, **kw)
    torch.manual_seed(9)
    out = DreamModel(eng).diffusion_generate(ids, attention_mask=mask, output_history=True,
                                             return_dict_in_generate=True, **kw)
    assert isinstance(out, DreamOutput) and torch.equal(out.sequences, ref)
    assert len(out.history) == 3 and all(torch.equal(a, b) for a, b in zip(out.history, ref_hist))
    torch.manual_seed(9)
    plain = DreamModel(eng).diffusion_generate(ids, attention_mask=mask, **kw)
    assert torch.equal(plain, ref)
    torch.manual_seed(9)
    no_hist = diffusion_generate(eng, ids, attention_mask=mask, return_dict_in_generate=True, **kw)
    assert no_hist.history is None and torch.equal(no_hist.sequences, ref)


def test_compat_accepts_a_model_or_a_name():
    model = random_model("llada")
    ids = torch.tensor([[3, 4, 5, 6]])
    a = generate(model, ids, steps=4, gen_length=4, block_length=4, mask_id=model.cfg.mask_id)
    b = generate(MosaicEngine(model, {"progress": False}), ids, steps=4, gen_length=4, block_length=4,
                 mask_id=model.cfg.mask_id)
    assert torch.equal(a, b)


@pytest.mark.parametrize("call, message", [
    (lambda e: generate(e, torch.tensor([[1, 2]]), steps=4, gen_length=4, block_length=4),
     r"mask_id=126336 is not this model's mask token id \(36\); pass mask_id=36"),
    (lambda e: generate(e, torch.tensor([[1, 2]]), steps=3, gen_length=4, block_length=2, mask_id=36),
     "multiple of the number of blocks"),
    (lambda e: generate(e, torch.tensor([[1.5, 2.0]]), mask_id=36), "tensor of token ids"),
    (lambda e: generate(e, torch.tensor([[1, 2]]), torch.tensor([[1, 0]]), mask_id=36), "left only"),
    (lambda e: diffusion_generate(e, torch.tensor([[1, 2]])), "Dream's sampler"),
])
def test_compat_refuses_clearly(call, message):
    with pytest.raises(InputError, match=message):
        call(engine("llada"))


def test_dream_compat_refusals():
    eng = engine("dream")
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(InputError, match="generation_logits_hook_func is not supported"):
        diffusion_generate(eng, ids, generation_logits_hook_func=lambda i, x, lg: lg)
    with pytest.raises(InputError, match="unknown diffusion_generate options"):
        diffusion_generate(eng, ids, colour="red")
    with pytest.raises(InputError, match="max_length is 3"):
        diffusion_generate(eng, ids, max_length=3)
    with pytest.raises(InputError, match="LLaDA's sampler"):
        generate(eng, ids, mask_id=eng.model.cfg.mask_id)
