"""iLLaDA and LLaDA2.x: config parsing by architecture fields, weights in the official key names,
and the native forward against plain re-implementations of the official forwards."""

import copy
import json

import pytest
import torch
from plain_families import (
    TINY_ILLADA,
    TINY_LLADA2,
    illada_forward,
    illada_keys,
    llada2_forward,
    llada2_keys,
    random_state,
)
from safetensors.torch import save_file

from mosaic.errors import CheckpointError
from mosaic.loader import load, save
from mosaic.models import PRESETS
from mosaic.models.families import config_from_hf
from mosaic.runtime.runner import NativeRunner


def checkpoint(tmp_path, raw, keys, seed=0, name="ckpt"):
    folder = tmp_path / name
    folder.mkdir()
    sd = random_state(keys(raw), seed)
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    return folder, sd


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_illada_parses_by_fields():
    cfg = config_from_hf(TINY_ILLADA)
    assert cfg.family == "illada" and cfg.num_kv_heads == 2 and cfg.tied and cfg.mask_id == 5 and cfg.eos_id == 2
    assert cfg.head_dim == 8 and not cfg.rope_fp32 and cfg.max_seq_len == 256


def test_illada_refuses_what_it_does_not_run():
    with pytest.raises(CheckpointError, match="layer_norm_eps"):
        config_from_hf(TINY_ILLADA | {"layer_norm_eps": 1e-5})
    with pytest.raises(CheckpointError, match="head_dim"):
        config_from_hf(TINY_ILLADA | {"head_dim": 16})


@pytest.mark.parametrize("padded", [False, True])
def test_illada_forward_matches_official(tmp_path, padded):
    folder, sd = checkpoint(tmp_path, TINY_ILLADA, illada_keys)
    model = load(folder, device="cpu", dtype="float32")
    assert model.lm_head is model.embed                      # tied, one tensor
    ids = torch.randint(6, 40, (2, 13), generator=torch.Generator().manual_seed(3))
    valid = None
    if padded:
        valid = torch.ones(2, 13, dtype=torch.bool)
        valid[1, :5] = False
    ours = NativeRunner(model).forward(ids, valid)
    ref = illada_forward(sd, TINY_ILLADA, ids, None if valid is None else valid.long())
    assert rel_err(ours, ref) < 1e-5


def test_llada2_parses_by_fields():
    cfg = config_from_hf(TINY_LLADA2)
    assert cfg.family == "llada2" and cfg.block_causal and cfg.rot_dim == 4 and cfg.qk_norm
    assert (cfg.num_experts, cfg.top_k, cfg.first_dense, cfg.dense_ffn, cfg.shared_ffn) == (8, 3, 1, 48, 12)
    assert (cfg.num_groups, cfg.topk_groups, cfg.route_score, cfg.route_scale) == (4, 2, "sigmoid", 2.5)


@pytest.mark.parametrize("change,word", [({"norm_head": True}, "norm_head"), ({"rotary_dim": 8}, "rotary_dim"),
                                         ({"n_group": 3}, "groups"), ({"score_function": "tanh"}, "score")])
def test_llada2_refuses_what_it_does_not_run(change, word):
    with pytest.raises(CheckpointError, match=word):
        config_from_hf(TINY_LLADA2 | change)


@pytest.mark.parametrize("change", [{}, {"score_function": "softmax", "n_group": 1, "topk_group": 1},
                                    {"use_qkv_bias": True, "use_bias": True, "num_shared_experts": 0}])
def test_llada2_forward_matches_official(tmp_path, change):
    raw = TINY_LLADA2 | change
    folder, sd = checkpoint(tmp_path, raw, llada2_keys)
    model = load(folder, device="cpu", dtype="float32")
    ids = torch.randint(0, 45, (2, 17), generator=torch.Generator().manual_seed(5))
    ours = NativeRunner(model).forward(ids, None)
    ref = llada2_forward(sd, raw, ids)
    assert rel_err(ours, ref) < 1e-5


def test_llada2_save_round_trip(tmp_path):
    folder, sd = checkpoint(tmp_path, TINY_LLADA2, llada2_keys)
    model = load(folder, device="cpu", dtype="float32")
    again = load(save(model, tmp_path / "again", copy.deepcopy(TINY_LLADA2)), device="cpu", dtype="float32")
    assert torch.equal(again.layers[1]["k"], model.layers[1]["k"])
    assert torch.equal(again.layers[2]["router_bias"], sd["model.layers.2.mlp.gate.expert_bias"])


def test_presets_have_the_published_geometry():
    il, l2 = load("illada-8b", device="meta"), load("llada2-mini", device="meta")
    assert il.lm_head is il.embed and round(il.weight_bytes() / 2 / 1e9, 2) == 7.62   # the model card's 7.62B
    total = l2.weight_bytes() / 2 / 1e9
    assert 16.0 < total < 16.5, total                                                  # "16B total"
    assert PRESETS["llada2-mini"].kv_dim == 512 and PRESETS["illada-8b"].kv_dim == 1024


@pytest.mark.parametrize("case", [dict(gen_length=8, steps=8, block_length=4),
                                  dict(gen_length=8, steps=4, block_length=8, temperature=0.7, seed=3),
                                  dict(gen_length=6, steps=6, block_length=6, remasking="random", seed=4)])
@pytest.mark.parametrize("native", [True, False])
def test_illada_tokens_equal_official_generate(tmp_path, case, native):
    """LLaDA's published generate.py with mask_id=5 (the iLLaDA README) over the official forward."""
    from official import llada_generate

    from mosaic import MosaicEngine
    folder, sd = checkpoint(tmp_path, TINY_ILLADA, illada_keys, seed=2)
    engine = MosaicEngine(load(folder, device="cpu", dtype="float32"), {"progress": False})
    prompts = [[7, 9, 11, 30, 12], [8, 20, 33]]
    seed = case.pop("seed", None)
    kw = {k: v for k, v in case.items() if k != "gen_length"}
    got = engine.generate(prompts, max_new_tokens=case["gen_length"], native=native, seed=seed, **kw)
    ids = torch.tensor([prompts[0], [0, 0] + prompts[1]])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    if seed is not None:
        torch.manual_seed(seed)
    ref = llada_generate(lambda x, m: illada_forward(sd, TINY_ILLADA, x, m), ids, mask, mask_id=5, **case)
    assert torch.equal(got.tokens, ref[:, 5:])


@pytest.mark.parametrize("case", [dict(gen_length=8, steps=8, block_length=4),
                                  dict(gen_length=8, steps=4, block_length=8, temperature=0.7, seed=3)])
def test_illada_through_compat_generate(tmp_path, case):
    """iLLaDA's published usage is LLaDA's generate.py with mask_id=5: mosaic.compat.generate
    takes the same call (its record's published_call) and gives the official tokens, seeded
    through torch.manual_seed as the official code is; another mask id is refused."""
    from official import llada_generate

    from mosaic.compat import generate
    from mosaic.errors import InputError
    folder, sd = checkpoint(tmp_path, TINY_ILLADA, illada_keys, seed=2)
    model = load(folder, device="cpu", dtype="float32")
    ids = torch.tensor([[7, 9, 11, 30, 12], [0, 0, 8, 20, 33]])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    seed = case.pop("seed", None)
    if seed is not None:
        torch.manual_seed(seed)
    got = generate(model, ids, mask, mask_id=5, **case)
    if seed is not None:
        torch.manual_seed(seed)
    ref = llada_generate(lambda x, m: illada_forward(sd, TINY_ILLADA, x, m), ids, mask, mask_id=5, **case)
    assert torch.equal(got, ref)
    with pytest.raises(InputError, match=r"mask_id=126336 is not this model's mask token id \(5\)"):
        generate(model, ids, mask, **case)
