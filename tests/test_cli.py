import json
import subprocess
import sys
import time

import pytest
from conftest import bundled, random_model

from mosaic import EngineConfig, InputError, MosaicEngine
from mosaic.cli import main


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "mosaic", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_with_no_arguments_answers_correctly():
    bundled("tiny-llada")
    t0 = time.perf_counter()
    out = run_cli("generate", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "sort 31415926=11234569"
    assert "steps in" in out.stderr and "peak" in out.stderr
    assert time.perf_counter() - t0 < 30


def test_generate_json_and_batch():
    bundled("tiny-llada")
    out = run_cli("generate", "--json", "--prompt", "12+30=", "--prompt", "sort 4321=")
    rec = json.loads(out.stdout)
    assert rec["texts"] == ["42", "1234"] and rec["path"] == "planned"


def test_plan_json_has_the_fields(capsys):
    assert main(["plan", "--model", "llada-8b", "--tokens", "8192", "--masked", "409", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert {"plan_bytes", "load_bytes", "plan_ms", "planner"} <= set(rec)
    assert rec["plan_bytes"] >= rec["load_bytes"] > 8192 * 4096 * 2  # at least the residual


def test_plan_table(capsys):
    assert main(["plan", "--model", "dream-7b", "--tokens", "4096", "--planner", "first-fit"]) == 0
    out = capsys.readouterr().out
    assert "first-fit" in out and "LOAD" in out


def test_cli_reports_bad_block_length(capsys):
    bundled("tiny-llada")
    code = main(["generate", "--no-progress", "--gen-length", "8", "--block-length", "3"])
    assert code == 2
    assert "not divisible by --block-length 3" in capsys.readouterr().err


def test_cli_names_a_value_no_flag_set_as_generation_config_jsons(capsys):
    """tiny-llada's generation_config.json sets steps 8 and max_new_tokens 8: its steps fit the
    blocks (rounded up; test_steps_bound.py), a --steps given that does not is refused, and an
    error about its max_new_tokens names it as the file's."""
    bundled("tiny-llada")
    assert main(["generate", "--no-progress", "--gen-length", "16", "--block-length", "1"]) == 0
    capsys.readouterr()
    assert main(["generate", "--no-progress", "--gen-length", "16", "--block-length", "1", "--steps", "8"]) == 2
    assert "generation_config.json" not in capsys.readouterr().err
    assert main(["generate", "--no-progress", "--block-length", "3"]) == 2
    assert "--gen-length 8 (from generation_config.json) is not divisible" in capsys.readouterr().err


def test_small_sizes_read_in_bytes_or_kib(capsys):
    from mosaic.errors import gib
    assert [gib(n) for n in (0, 512, 1024, 50 * 1024, 200 * 1024, 3 * 2**30)] == \
        ["0 bytes", "512 bytes", "1.0 KiB", "50.0 KiB", "0.2 MiB", "3.00 GiB"]
    assert main(["plan", "--model", "llada-8b", "--budget", "1KiB"]) == 2
    assert "llada-8b at 1.0 KiB:" in capsys.readouterr().err     # it said "at 0.0 MiB"


def test_negative_looking_ids_reach_the_vocabulary_check(capsys):
    """argparse read `--ids -3,4` as a flag: `expected one argument`."""
    bundled("tiny-llada")
    for argv in (["--ids", "-3,4"], ["--ids=-3,4"], ["--ids", "4", "--ids", "-1"]):
        assert main(["generate", "--no-progress", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: token ids [") and "outside the vocabulary [0, 21)" in err, err
    assert main(["generate", "--ids", "--json"]) == 2                      # a flag after --ids is still no value
    assert "argument --ids: expected one argument" in capsys.readouterr().err


def test_a_negative_budget_reaches_the_budget_check(capsys):
    """`--budget -1GiB` was `expected one argument`; it is read as a size and refused as one."""
    assert main(["generate", "--no-progress", "--budget", "-1GiB", "--prompt", "sort 12="]) == 2
    assert "cannot read memory size '-1GiB'" in capsys.readouterr().err
    assert main(["generate", "--no-progress", "--budget", "0", "--prompt", "sort 12="]) == 2
    assert "must be positive: a size" in capsys.readouterr().err


def test_name_defaults_marks_only_values_the_caller_never_set():
    from mosaic.config import name_defaults
    defaults = {"steps": 8, "gen_length": 16, "remasking": "random"}
    msg = "steps 8 must divide gen_length 16; remasking='random'; steps 80"
    assert name_defaults(msg, {}, defaults) == ("steps 8 (from generation_config.json) must divide gen_length 16 "
                                                "(from generation_config.json); remasking='random' (from "
                                                "generation_config.json); steps 80")
    assert name_defaults(msg, {"steps": 8, "max_new_tokens": 16, "remasking": "random"}, defaults) == msg
    assert name_defaults(msg, {"steps": None}, defaults).startswith("steps 8 (from generation_config.json)")


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=8, block_length=3), "not divisible by block_length 3"),
    (dict(max_new_tokens=8, block_length=4, steps=3), "multiple of the number of blocks"),
    (dict(max_new_tokens=0), "must be positive"),
    (dict(max_new_tokens=8, remasking="sideways"), "remasking 'sideways'"),
    (dict(max_new_tokens=8, colour="red"), "unknown generation options"),
    (dict(max_new_tokens=8, alg="entropy"), "Dream sampler options"),
])
def test_bad_generation_arguments(kwargs, message):
    engine = MosaicEngine(random_model("llada"), {"progress": False})
    with pytest.raises(InputError, match=message):
        engine.generate([1, 2, 3], **kwargs)


def test_bad_prompts():
    engine = MosaicEngine(random_model("dream"), EngineConfig(progress=False, max_length=12))
    with pytest.raises(InputError, match="outside the vocabulary"):
        engine.generate([1, 999], max_new_tokens=4)
    with pytest.raises(InputError, match="no tokenizer"):
        engine.generate("hello", max_new_tokens=4)
    with pytest.raises(InputError, match="exceeds max_length 12"):
        engine.generate(list(range(10)), max_new_tokens=4)
    with pytest.raises(InputError, match="alg 'best'"):
        engine.generate([1, 2], max_new_tokens=4, alg="best")
    with pytest.raises(InputError, match="cfg_scale is a LLaDA"):
        engine.generate([1, 2], max_new_tokens=4, cfg_scale=1.0)


def test_engine_config_as_dict_or_dataclass():
    with pytest.raises(InputError, match="unknown EngineConfig fields"):
        MosaicEngine(random_model("llada"), {"budgett": "1GiB"})
    e = MosaicEngine(random_model("llada"), EngineConfig(progress=False))
    assert e.generate([3, 4, 5], max_new_tokens=4).tokens.shape == (1, 4)
    with pytest.raises(InputError, match=r"attention='flash' is not one of \('sdpa', 'cudnn', 'triton'\)"):
        EngineConfig(attention="flash")
    with pytest.raises(InputError, match="arena='gpu'"):
        MosaicEngine(random_model("llada"), {"arena": "gpu"})


def test_plan_checks_and_labels_a_sparse_config(tmp_path, capsys):
    """`mosaic plan --config` with sparse ranges: ranges past the model's layers are refused (as
    generate refuses them), and the sparse steps are planned and labelled lossy (QA finding)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("sparse:\n  block: 16\n  ranges:\n    - {layers: [0, 99], pattern: topk, keep: 0.2}\n")
    assert main(["plan", "--model", "tiny-llada", "--budget", "2GiB", "--config", str(bad)]) == 2
    assert "sparse ranges reach layer 99" in capsys.readouterr().err
    good = tmp_path / "good.yaml"
    good.write_text("sparse:\n  block: 16\n  dense_steps: 0\n  ranges:\n"
                    "    - {layers: [0, 5], pattern: topk, keep: 0.2}\n")
    assert main(["plan", "--model", "tiny-llada", "--budget", "1GiB", "--config", str(good), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["lossy"] and "sparse" in rep["lossy"][0]
    assert main(["plan", "--model", "tiny-llada", "--budget", "1GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["l_max"] >= rep["l_max"]   # sparse layouts cost memory


def test_a_text_prompt_for_a_preset_is_refused_before_its_weights_exist(capsys, monkeypatch):
    import mosaic.cli as cli

    def no_engine(*a, **k):
        raise AssertionError("the engine (and the preset's weights) must not be built")
    monkeypatch.setattr(cli, "MosaicEngine", no_engine)
    assert cli.main(["generate", "--model", "llada-moe-7b", "--prompt", "hi"]) == 2
    assert "prompts must be token ids (--ids 1,2,3)" in capsys.readouterr().err


def test_a_missing_model_is_named_before_a_missing_prompt(capsys):
    assert main(["generate", "--no-progress", "--model", "no-such-folder"]) == 2
    assert "model folder 'no-such-folder' does not exist" in capsys.readouterr().err
    assert main(["generate", "--no-progress", "--model", "tiny-dream"]) == 2
    assert "no prompt" in capsys.readouterr().err
