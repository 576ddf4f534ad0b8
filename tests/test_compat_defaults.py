"""mosaic.compat.diffusion_generate inherits what the official method inherits: without a
generation_config, DreamGenerationConfig.from_model_config(model.config), which under
transformers 4.46.2 carries temperature 1.0, top_k 50 and top_p 1.0 from PretrainedConfig and
any of its fields config.json sets; with one, DreamGenerationConfig's own defaults."""

import torch
from conftest import random_model
from official import dream_generate

from mosaic import MosaicEngine
from mosaic.compat import diffusion_generate, official_base
from mosaic.models.families import config_to_hf

WIDE = dict(vocab=64, mask_id=63, eos_id=62, bos_id=61, pad_id=62)   # > 50 ids: top_k 50 filters


def engine(**hf):
    eng = MosaicEngine(random_model("dream", **WIDE), {"progress": False})
    eng.model.hf_config = {**config_to_hf(eng.model.cfg), **hf}
    return eng


def run(eng, ref_kw, **kw):
    """(compat's sequences for kw, the oracle's for ref_kw), both seeded alike."""
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    net = lambda x, m: eng.forward_logits(x, m)  # noqa: E731
    torch.manual_seed(4)
    ref = dream_generate(net, ids, mask_token_id=eng.model.cfg.mask_id, **ref_kw)
    torch.manual_seed(4)
    return diffusion_generate(eng, ids, **kw), ref


SHORT = dict(max_new_tokens=8, steps=4, alg="entropy")


def test_inherited_sampling_defaults_match_the_official_call():
    eng = engine()
    base = official_base(eng.model.hf_config)
    assert (base["temperature"], base["top_k"], base["top_p"], base["steps"]) == (1.0, 50, 1.0, 512)
    ours, ref = run(eng, SHORT, **SHORT)
    assert torch.equal(ours, ref)
    greedy, _ = run(eng, SHORT, **SHORT, temperature=0.0)
    assert not torch.equal(ours, greedy)     # the inherited temperature 1.0 is not greedy
    k7, ref7 = run(eng, dict(SHORT, top_k=7), **SHORT, top_k=7)
    assert torch.equal(k7, ref7)


def test_config_json_fields_of_those_names_are_inherited():
    eng = engine(temperature=0.0, top_k=None, steps=4)            # None values are dropped
    assert official_base(eng.model.hf_config)["top_k"] == 50
    ours, ref = run(eng, dict(temperature=0.0, steps=4, max_new_tokens=8, alg="maskgit_plus"),
                    max_new_tokens=8, alg="maskgit_plus")
    assert torch.equal(ours, ref)


def test_a_passed_generation_config_uses_dream_generation_config_defaults():
    eng = engine()
    ours, ref = run(eng, dict(SHORT, temperature=0.0, top_k=None, top_p=None),
                    generation_config={"steps": 4}, max_new_tokens=8, alg="entropy")
    assert torch.equal(ours, ref)
