"""`mosaic chat` through piped stdin and `mosaic bench` on the CPU with the bundled model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import bundled

from mosaic.cli import main

ROOT = Path(__file__).parents[2]


def run_cli(*args, stdin=None, timeout=120):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "mosaic", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_chat_keeps_history_and_streams():
    bundled("tiny-llada")
    out = run_cli("chat", "--device", "cpu", "--max-new-tokens", "8", "--steps", "8", "--system", "sort ",
                  stdin="31415926=\n\n4321=\n/reset\n907=\n/nonsense\n")
    assert out.returncode == 0, out.stderr
    answers = [ln for ln in out.stdout.splitlines() if ln.startswith("mosaic> ")]
    assert len(answers) == 3
    # the template joins the system prompt and the turns: "sort " + "31415926=" is the task
    assert answers[0] == "mosaic> 11234569" and answers[2] == "mosaic> 079"
    contexts = [ln for ln in out.stderr.splitlines() if ln.startswith("[context ")]
    used = [int(ln.split()[1].replace(",", "")) for ln in contexts]
    assert used[1] > used[0] + 8                     # the second turn carries the first one
    assert used[2] < used[1]                         # /reset forgot it
    assert "capacity unbounded" in out.stderr and "(history cleared)" in out.stderr
    assert "unknown command /nonsense" in out.stderr


def test_chat_shows_capacity_and_refuses_a_full_context():
    bundled("tiny-llada")
    out = run_cli("chat", "--device", "cpu", "--max-new-tokens", "8", "--steps", "8", "--max-seq-len", "30",
                  stdin="sort 31415926=\nsort 4321=\n")
    assert out.returncode == 0, out.stderr
    assert "capacity 30 tokens" in out.stderr and "[context 23 / 30 tokens]" in out.stderr
    assert "the context is full" in out.stderr and "/reset" in out.stderr
    assert out.stdout.count("mosaic> ") == 1


def test_chat_refuses_a_bad_option():
    bundled("tiny-llada")
    out = run_cli("chat", "--device", "cpu", "--max-new-tokens", "8", "--block-length", "3", stdin="")
    assert out.returncode == 2 and out.stderr.startswith("error: ") and "block-length 3" in out.stderr


def test_bench_cpu_preset_json(capsys):
    bundled("tiny-llada")
    assert main(["bench", "--preset", "cpu", "--runs", "2", "--device", "cpu", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["model"] == "tiny-llada" and rec["output_len"] == 8 and rec["steps"] == 8
    lat, thr = rec["latency"], rec["throughput"]
    assert lat["runs"] == 2 and 0 < lat["p50_s"] <= lat["p90_s"] and lat["canvas_tokens_per_s"] > 0
    assert thr["batch_size"] == 4 and thr["canvas_tokens_per_s"] > 0
    assert rec["capacity_tokens"] is None            # no budget: nothing limits it


def test_bench_capacity_under_a_budget(capsys, tmp_path):
    bundled("tiny-llada")
    from mosaic import MosaicEngine
    fixed = MosaicEngine("tiny-llada", {"device": "cpu"}).budget.fixed_bytes
    out = tmp_path / "bench.json"
    assert main(["bench", "--preset", "cpu", "--runs", "1", "--batch-size", "2", "--device", "cpu",
                 "--budget", f"{fixed + 1_000_000}B", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "latency" in table and "throughput" in table and "capacity" in table
    rec = json.loads(out.read_text())
    assert 100 < rec["capacity_tokens"] < 2000 and rec["latency"]["predicted_bytes"] <= fixed + 1_000_000


def test_bench_names_the_flags_the_user_gives(capsys):
    """--output-len is bench's canvas flag (it used to say --gen-length, which bench has not);
    generation_config.json's steps 8 is rounded up to the 16 blocks, a --steps 8 given is refused."""
    bundled("tiny-llada")
    assert main(["bench", "--output-len", "6", "--block-length", "4", "--device", "cpu", "--runs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --output-len 6 is not divisible by --block-length 4") and "gen-length" not in err
    assert main(["bench", "--output-len", "16", "--block-length", "1", "--device", "cpu", "--runs", "1"]) == 0
    capsys.readouterr()
    assert main(["bench", "--output-len", "16", "--block-length", "1", "--steps", "8", "--device", "cpu",
                 "--runs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --steps 8 must be") and "--output-len 16" in err, err


@pytest.mark.parametrize("cmd", ["serve", "chat", "bench"])
def test_max_seq_len_is_checked_as_the_flag(capsys, cmd):
    """It used to say `max_length=0 must be ...`, a name the command line does not have."""
    assert main([cmd, "--max-seq-len", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: argument --max-seq-len: must be at least 1, got 0") and err.count("\n") == 1, err


def test_bench_unknown_preset_is_an_error(capsys):
    assert main(["bench", "--preset", "nope"]) == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_serve_refuses_a_bad_port_or_host_at_parsing(capsys):
    for args, message in ((["--port", "99999"], "99999 is out of range: a port is 0-65535"),
                          (["--port", "-1"], "-1 is out of range"),
                          (["--port", "http"], "'http' is not a port number"),
                          (["--host", " "], "argument --host: empty")):
        assert main(["serve", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and err.startswith("error: "), err
        assert "Traceback" not in err


def test_chat_checks_the_system_prompt_once_and_bench_counts(capsys):
    """A system prompt the tokenizer cannot encode is one error before the first turn (it used to
    fail every turn with exit code 0); bench --runs 0 is an argument error, not a traceback."""
    bundled("tiny-llada")
    out = run_cli("chat", "--device", "cpu", "--system", "Be brief.", stdin="sort 1=\n")
    assert out.returncode == 2 and out.stderr.startswith("error: --system:") and out.stderr.count("error") == 1
    assert main(["bench", "--preset", "cpu", "--runs", "0"]) == 2
    assert "--runs: must be at least 1" in capsys.readouterr().err
