"""The serve load test (`python -m bench serve_load --cpu`) on the bundled model: every request
completes at concurrency 1 and 4 (each level warmed first), the concurrent ones share steps, and
the same engine's generate() of each level's batch is measured beside it."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_load_test_completes_and_batches(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench", "serve_load", "--cpu", "--requests", "2", "--prompt-mean",
                        "12", "--max-tokens", "8", "--options", "{}", "--prompt-dist", "fixed", "--warm", "--peer",
                        "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads((tmp_path / "serve_load_cpu.json").read_text())
    levels = {row["concurrency"]: row for row in rec["levels"]}
    assert levels[1]["completed"] == 2 and levels[4]["completed"] == 8
    assert not levels[4]["refusals"] and levels[4]["batch"]["stacked_steps"] > 0
    assert "tok/s" in r.stdout.splitlines()[-3]       # the table is printed last
    for row in levels.values():      # --peer: generate() of the level's batch on the same engine
        assert row["engine"]["tok_per_s"] > 0 and row["served_over_engine"] == row["output_tok_per_s"] / \
            row["engine"]["tok_per_s"]
