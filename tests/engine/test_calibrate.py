"""mosaic calibrate: the YAML round-trips and the engine accepts it; bad input is one clear
error; the bundled oracle's run (slow)."""

import pytest
import yaml
from conftest import bundled, random_model

from mosaic import InputError, MosaicEngine, calibrate
from mosaic.cli import main
from mosaic.config import SparseConfig, SparseRange
from mosaic.config_file import load_engine_config
from mosaic.engine.calibrate import check_target, read_prompts, write_yaml
from mosaic.errors import ConfigFileError

CFG = SparseConfig((SparseRange((1, 1), "topk", 0.2), SparseRange((2, 3), "window", 1.0, 2, 0)),
                   block=64, dense_steps=1, estimate="rows")
RECORD = {"target": {"min_recall": 0.95}, "layers": [{"layer": 0, "recall": 0.99}], "accuracy": None}


def test_the_yaml_round_trips_and_the_engine_runs_it(tmp_path):
    path = tmp_path / "engine.yaml"
    write_yaml(path, {"sparse": CFG, "calibration": RECORD})
    assert yaml.safe_load(path.read_text())["calibration"] == RECORD
    assert load_engine_config(path).sparse == CFG
    m = random_model("llada", num_layers=4)
    engine = MosaicEngine(m, path)
    assert engine.config.sparse == CFG
    assert engine.generate([[1, 2, 3] * 40], max_new_tokens=4, steps=2).tokens.shape[-1] == 4


def test_an_all_dense_choice_writes_no_sparse_section(tmp_path):
    path = tmp_path / "engine.yaml"
    write_yaml(path, {"sparse": None, "calibration": RECORD})
    assert load_engine_config(path).sparse is None


def test_a_calibration_record_must_be_a_mapping(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("calibration: [1, 2]\n")
    with pytest.raises(ConfigFileError, match="calibration"):
        load_engine_config(path)


@pytest.mark.parametrize("kw, match", [
    ({"min_recall": 0.0}, "min_recall"), ({"min_recall": 1.5}, "min_recall"),
    ({"max_loss": -1}, "max_loss"), ({"max_loss": 100}, "max_loss"), ({"max_kl": -0.1}, "max_kl")])
def test_targets_out_of_range(kw, match):
    args = {"min_recall": 0.95, "max_loss": None, "max_kl": 0.01} | kw
    with pytest.raises(InputError, match=match):
        check_target(**args)


def test_prompt_files(tmp_path):
    (tmp_path / "p.jsonl").write_text('"one"\n{"prompt": "two"}\n\n{"text": "three"}\n')
    assert read_prompts(tmp_path / "p.jsonl") == ["one", "two", "three"]
    (tmp_path / "p.txt").write_text("a b\nc d\n")
    assert read_prompts(tmp_path / "p.txt") == ["a b", "c d"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": 3}\n')
    with pytest.raises(InputError, match="line 1"):
        read_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(InputError, match="no prompt"):
        read_prompts(tmp_path / "empty.txt")
    with pytest.raises(InputError, match="does not exist"):
        read_prompts(tmp_path / "missing.txt")


def _err(capsys, *args):
    assert main(["calibrate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "Traceback" not in err and len(err.splitlines()) == 1
    return err


def test_cli_errors(tmp_path, capsys):
    out = str(tmp_path / "e.yaml")
    assert "does not exist" in _err(capsys, "tiny-long", "--out", out, "--prompts", str(tmp_path / "nope.txt"))
    assert "--min-recall" in _err(capsys, "tiny-long", "--out", out, "--min-recall", "1.5")
    assert "--max-loss" in _err(capsys, "tiny-long", "--out", out, "--max-loss", "200")
    assert "--lengths" in _err(capsys, "tiny-long", "--out", out, "--lengths", "4k")
    assert "not both" in _err(capsys, "tiny-long", "--out", out, "--prompts", "p.txt", "--tasks", "kv")
    assert "YAML" in _err(capsys, "tiny-long", "--out", str(tmp_path / "e.json"))
    assert "does not exist" in _err(capsys, "tiny-long", "--out", str(tmp_path / "no" / "e.yaml"))
    assert "--out" in _err(capsys, "tiny-long")


def test_cli_errors_that_need_the_model(tmp_path, capsys):
    bundled("tiny-long")
    bundled("tiny-llada")
    out = str(tmp_path / "e.yaml")
    assert "unknown task" in _err(capsys, "tiny-long", "--out", out, "--tasks", "kv,sort")
    assert "trained length" in _err(capsys, "tiny-long", "--out", out, "--lengths", "65536")
    assert "key blocks" in _err(capsys, "tiny-long", "--out", out, "--lengths", "256")
    assert "long-context tasks" in _err(capsys, "tiny-llada", "--out", out)


@pytest.mark.slow
def test_calibrate_the_bundled_oracle_at_1k(tmp_path):
    bundled("tiny-long")
    path = tmp_path / "engine.yaml"
    doc = calibrate("tiny-long", path, lengths=(1024,), n=2, eval_n=2, threads=1, progress=False,
                    compare_uniform=False)
    rec = doc["calibration"]
    assert len(rec["layers"]) == 4 and rec["block"] == 64 and rec["canvases"] == 6
    assert set(rec["accuracy"]["exact_percent"]) == {"dense", "calibrated"}
    # layers 2-3 of tiny-long attend diffusely (measured: block entropy ~0.98 at 2k-4k)
    assert all(rec["layers"][i]["entropy"] > 0.8 for i in (2, 3))
    assert load_engine_config(path).sparse == doc["sparse"]
    sp = rec["modelled_speedup"]
    assert sp["llada_8b_128k"]["speedup"] >= 1 and "modelled" in sp["label"]
