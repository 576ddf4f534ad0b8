import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mosaic import CheckpointError, load
from mosaic.loader import save
from mosaic.models.families import config_from_hf


def test_round_trip(family, saved, tmp_path):
    folder, model = saved(family)
    back = load(folder, device="cpu", dtype="float32")
    assert back.cfg == model.cfg
    again = save(back, tmp_path / "again")
    a, b = load_file(str(folder / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sharded_checkpoint(saved):
    folder, model = saved("dream")
    sd = load_file(str(folder / "model.safetensors"))
    keys = sorted(sd)
    half = len(keys) // 2
    save_file({k: sd[k] for k in keys[:half]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({k: sd[k] for k in keys[half:]}, str(folder / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {k: f"model-0000{1 + (i >= half)}-of-00002.safetensors"
                            for i, k in enumerate(keys)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model.safetensors").unlink()
    back = load(folder, device="cpu")
    assert torch.equal(back.layers[1]["v_bias"], model.layers[1]["v_bias"])


def test_missing_folder_names_alternatives(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist.*presets"):
        load(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load(tmp_path)


def test_missing_weights_file(saved):
    folder, _ = saved("llada")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load(folder)


def test_unknown_model_type(saved):
    folder, _ = saved("llada")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="unknown model_type 'gpt2'"):
        load(folder)


def test_missing_and_unexpected_tensors_are_listed(saved):
    folder, _ = saved("llada")
    sd = load_file(str(folder / "model.safetensors"))
    sd.pop("model.transformer.blocks.1.up_proj.weight")
    sd["model.transformer.blocks.1.extra.weight"] = torch.zeros(2)
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing \['model.transformer.blocks.1.up_proj.weight'\]"
                       r".*unexpected \['model.transformer.blocks.1.extra.weight'\]"):
        load(folder)


def test_misshaped_tensor(saved):
    folder, _ = saved("dream")
    sd = load_file(str(folder / "model.safetensors"))
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(5, 32)
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"up_proj.weight: \(5, 32\), expected \(48, 32\)"):
        load(folder)


def test_unsupported_tensor_dtype(saved):
    folder, _ = saved("llada")
    sd = load_file(str(folder / "model.safetensors"))
    sd["model.transformer.ln_f.weight"] = sd["model.transformer.ln_f.weight"].to(torch.int8)
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="dtypes not supported.*I8"):
        load(folder)


def test_unsupported_engine_dtype(saved):
    folder, _ = saved("llada")
    with pytest.raises(CheckpointError, match="dtype 'int4' is not supported"):
        load(folder, dtype="int4")


def test_moe_told_apart_from_dense_llada():
    dense = config_from_hf({"model_type": "llada", "d_model": 64, "n_layers": 2, "n_heads": 4,
                                 "mlp_hidden_size": 96, "vocab_size": 50, "embedding_size": 64,
                                 "mask_token_id": 49})
    moe = config_from_hf({"model_type": "llada", "hidden_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
                               "expert_intermediate_size": 16, "vocab_size": 50,
                               "partial_rotary_factor": 0.5, "mask_token_id": 49})
    assert dense.family == "llada" and dense.vocab == 64  # logit width is embedding_size
    assert moe.family == "llada_moe" and moe.rot_dim == 8 and moe.top_k == 2


def test_preset_on_meta_takes_no_memory():
    m = load("llada-8b", device="meta")
    assert m.embed.device.type == "meta" and m.weight_bytes() > 15e9


def test_a_bundled_model_not_shipped_yet_says_how_to_get_it(monkeypatch, tmp_path):
    """tiny-long is trained on a GPU; until its folder is shipped, loading it names the command."""
    import mosaic.loader as loader_mod
    from mosaic.errors import CheckpointError
    monkeypatch.setitem(loader_mod.BUNDLED, "tiny-long", tmp_path / "absent")
    with pytest.raises(CheckpointError, match="tools/train_long.py"):
        loader_mod.load("tiny-long", device="cpu")
