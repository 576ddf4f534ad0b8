"""YAML engine configs: loaded, validated with the key's path in the error, and driving generation."""

import pytest

from mosaic import InputError, MosaicEngine
from mosaic.cli import main
from mosaic.config import EngineConfig, SparseConfig
from mosaic.config_file import load_engine_config

GOOD = """
memory_budget: 2GiB
planner: best
sparse:
  block: 16
  dense_steps: 2
  ranges:
    - {layers: [0, 1], pattern: window, window: 1}
    - {layers: [2, 5], pattern: topk, keep: 0.5, global_blocks: 1}
"""


def write(tmp_path, text, name="engine.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_a_good_file_loads_into_the_frozen_configs(tmp_path):
    cfg = load_engine_config(write(tmp_path, GOOD))
    assert isinstance(cfg, EngineConfig) and isinstance(cfg.sparse, SparseConfig)
    assert cfg.planner == "best" and cfg.sparse.ranges[1].keep == 0.5
    assert cfg.sparse.for_layer(3).pattern == "topk" and cfg.sparse.for_layer(9) is None


@pytest.mark.parametrize("text, where", [
    ("colour: red\n", "colour"),
    ("planner: fastest\n", "planner"),
    ("sparse: {ranges: [{layers: [0, 1], keep: 2.0}]}\n", "sparse.ranges.0"),
    ("sparse: {ranges: [{layers: [3, 1]}]}\n", "sparse.ranges.0"),
    ("sparse: {block: 100}\n", "sparse"),
    ("sparse: {ranges: [{layers: [0, 2]}, {layers: [2, 3]}]}\n", "both cover layer 2"),
    ("sparse: {ranges: [{layers: [0, 1], windw: 2}]}\n", "windw"),
    ("- a list\n", "top level must be a mapping"),
    ("a: [unclosed\n", "not valid YAML"),
])
def test_bad_files_name_the_key(tmp_path, text, where):
    with pytest.raises(InputError, match=where):
        load_engine_config(write(tmp_path, text))


def test_the_file_drives_generation_and_is_labelled(tmp_path):
    engine = MosaicEngine("tiny-llada", write(tmp_path, GOOD.replace("2GiB", "1GiB")) )
    out = engine.generate("sort 31415926=", progress=False)
    assert out.text == "11234569"
    assert any("block-sparse" in label for label in out.lossy)


def test_ranges_past_the_model_are_refused(tmp_path):
    with pytest.raises(InputError, match="layers 0-5"):
        MosaicEngine("tiny-llada", write(tmp_path, "sparse: {ranges: [{layers: [0, 27]}]}\n"))


def test_cli_config_and_flag_override(tmp_path, capsys):
    path = write(tmp_path, GOOD)
    assert main(["generate", "--config", str(path), "--no-progress", "--planner", "first-fit"]) == 0
    assert "11234569" in capsys.readouterr().out
    assert main(["generate", "--config", str(tmp_path / "missing.yaml"), "--no-progress"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_reports_the_files_own_keys_in_one_line(tmp_path, capsys):
    """A YAML error names the file's keys (memory_budget, not --budget), lists the allowed keys
    only for an unknown one, and a syntax error is one line (QA findings)."""
    bad = tmp_path / "u.yaml"
    bad.write_text("bogus_key: 1\n")
    assert main(["generate", "--no-progress", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bogus_key: unknown key; allowed:" in err and "memory_budget" in err and "--budget" not in err
    broken = tmp_path / "s.yaml"
    broken.write_text("sparse: [1, 2\n")
    assert main(["generate", "--no-progress", "--config", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not valid YAML at line" in err
    nested = tmp_path / "p.yaml"
    nested.write_text("precision:\n  ranges:\n    - {layers: [0, 3], dtype: int4}\n")
    assert main(["generate", "--no-progress", "--config", str(nested)]) == 2
    err = capsys.readouterr().err
    assert "precision.ranges.0:" in err and "tuple" not in err and "PrecisionConfig" not in err


@pytest.mark.parametrize("text, where", [
    ("dtype: float16\nplanner: best\ndtype: bfloat16\n", "line 3.*'dtype'.*line 1"),
    ("sparse:\n  block: 16\n  block: 32\n", "line 3.*'block'.*line 2")])
def test_a_key_given_twice_is_refused_with_its_lines(tmp_path, capsys, text, where):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match=where):
        load_engine_config(path)
    assert main(["generate", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "duplicate key" in err[0]
