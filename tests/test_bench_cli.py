"""`python -m bench`: the suite list, a bad suite name, and one cheap suite on the bundled model
on the CPU (its JSON record carries the header and the raw numbers; a table is printed last)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import bundled

ROOT = Path(__file__).parents[1]


def test_list_names_every_suite_one_line_each():
    from bench.suites import SUITES
    out = subprocess.run([sys.executable, "-m", "bench", "--list"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert [ln.split()[0] for ln in lines] == list(SUITES)
    assert "speed" in SUITES and "multi_gpu" in SUITES


def test_a_reader_that_leaves_early_ends_the_list_quietly():
    """`python -m bench --list | head` used to end with a BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "bench", "--list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    proc.stdout.close()          # the reader is gone before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 0 and err == "", err


def test_unknown_or_missing_suite_is_one_error_line(capsys):
    from bench.__main__ import main
    assert main(["nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: unknown suite 'nope'") and "eval_tiny" in err[0]
    assert main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: name a suite")


def test_eval_tiny_on_the_cpu_writes_a_record_and_prints_a_table(tmp_path, capsys):
    import torch
    bundled("tiny-llada")
    from bench.__main__ import main
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # 8 prompts of a 5 MB model: extra threads only contend on a busy machine
    try:
        assert main(["eval_tiny", "--per-shape", "1", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    rec = json.loads((tmp_path / "tiny_accuracy_tiny-llada.json").read_text())
    for key in ("date", "commit", "machine", "torch", "triton", "gpu", "config", "suite"):
        assert key in rec, key
    assert rec["suite"] == "eval_tiny" and rec["config"]["per_shape"] == 1 and rec["count"] == 8
    assert rec["command"] == f"python -m bench eval_tiny --per-shape 1 --out {tmp_path}"
    assert 0 <= rec["accuracy"] <= 1 and rec["lossy"] == []
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("all ")
