"""`python -m bench scenarios` (a GPU suite) runs end to end on the CPU with --dry-run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import bundled

pytest.importorskip("fastapi")
ROOT = Path(__file__).parents[2]


def test_scenarios_dry_run(tmp_path):
    bundled("tiny-llada")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "bench", "scenarios", "--dry-run", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    rec = json.loads((tmp_path / "scenarios.json").read_text())
    sc = rec["scenarios"]
    assert sc["long"]["total_tokens"] == 80 and sc["long"]["samples"] > 0
    assert sc["code"]["same_tokens"] is True and sc["code"]["native"]["path"] == "native"
    assert sc["chat"]["answered"] == sc["chat"]["rounds"] == 6 and len(sc["chat"]["per_round"]) == 6
    assert "scenario" in out.stdout.splitlines()[-4]      # the table is printed last
