"""Every generation_config.json field is used as the official code uses it or named in one
warning; end-of-text lists in either file end the text at any of their ids; the trained length
comes from whichever length field the checkpoint has."""

import json
import shutil
import warnings

import pytest
import torch
from conftest import random_model

from mosaic import MosaicEngine, load
from mosaic.checkpoint_fields import ConfigFieldWarning, generation_fields
from mosaic.errors import CheckpointError
from mosaic.loader import BUNDLED, save

IDS = {"eos_id": 18, "extra_eos_ids": (), "pad_id": 18, "bos_id": 17, "mask_id": 19, "eot_id": 20}


def test_an_eos_list_in_generation_config_adds_every_id():
    _, ids = generation_fields({"eos_token_id": [20, 18]}, IDS, 21, set())
    assert ids["eos_id"] == 18 and ids["extra_eos_ids"] == (20,)
    _, ids = generation_fields({"eos_token_id": 7}, {**IDS, "eos_id": None}, 21, set())
    assert ids["eos_id"] == 7 and ids["extra_eos_ids"] == ()
    with pytest.raises(CheckpointError, match="eos_token_id"):
        generation_fields({"eos_token_id": [20, 99]}, IDS, 21, set())


def test_fields_nothing_reads_are_named_once():
    data = {"steps": 4, "max_new_tokens": 8, "do_sample": True, "max_length": 30, "pad_token_id": 3,
            "bos_token_id": 17, "transformers_version": "4.46.2", "repetition_penalty": 1.1}
    with pytest.warns(ConfigFieldWarning) as got:
        defaults, _ = generation_fields(data, IDS, 21, {"steps", "max_new_tokens"})
    assert defaults == {"steps": 4, "max_new_tokens": 8} and len(got) == 1
    text = str(got[0].message)
    for name in ("do_sample", "max_length", "pad_token_id=3", "repetition_penalty"):
        assert name in text
    assert "bos_token_id" not in text and "transformers_version" not in text   # same id / bookkeeping
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generation_fields({"steps": 4, "eos_token_id": 18}, IDS, 21, {"steps"})   # all used: silent


def test_bundled_generation_configs_are_read_whole():
    for name in ("tiny-llada", "tiny-dream", "tiny-long"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConfigFieldWarning)
            load(BUNDLED[name], device="cpu")


def _folder(tmp_path, gen_cfg: dict):
    folder = save(random_model("llada"), tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED["tiny-llada"] / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps(gen_cfg))
    return folder


def test_generation_config_eos_list_ends_the_text(tmp_path):
    """eos_token_id [20, 18] in generation_config.json: id 20 ends the decoded text too (it was
    dropped without a word)."""
    folder = _folder(tmp_path, {"eos_token_id": [33, 35], "steps": 4, "max_new_tokens": 4})
    e = MosaicEngine(folder, {"progress": False})
    assert e.model.cfg.eos_id == 35 and 33 in e.model.cfg.extra_eos_ids
    ids = torch.tensor([3, 4, 33, 5]).tolist()
    assert e.decode(ids) == e.decode(ids[:2])
    out = e.generate([1, 2, 3])
    assert out.steps == 4 and out.tokens.shape == (1, 4)    # the sampling defaults are used


@pytest.mark.parametrize("field", ["max_sequence_length", "max_position_embeddings"])
def test_trained_length_from_either_field(tmp_path, field):
    folder = save(random_model("llada"), tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("max_sequence_length", None)
    raw.pop("max_position_embeddings", None)
    raw[field] = 123
    (folder / "config.json").write_text(json.dumps(raw))
    assert load(folder, device="cpu").cfg.max_seq_len == 123
