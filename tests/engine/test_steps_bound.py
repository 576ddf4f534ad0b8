"""`steps` is bounded by what the sampler can use: one step per new token at most (a step commits
at least one token; Dream, whose schedule moves with every step: 512 or 32 per new token). More
is refused before any work, naming the largest allowed; a default from generation_config.json
above it is capped (the tokens are the capped run's). steps=10**9 used to build an 8 GB
[B, steps] schedule and hold the process for minutes; through the server it took the process
past its budget (admission did not charge it); `mosaic generate --steps 64` on an 8-token canvas
ran 64 steps silently."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import random_model

from mosaic import MosaicEngine
from mosaic.errors import InputError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    return MosaicEngine("tiny-llada", {"device": "cpu", "progress": False})


def test_steps_above_the_canvas_are_refused_at_once(tiny):
    t0 = time.perf_counter()
    with pytest.raises(InputError, match="steps 1000000000 is more than .* at most 8") as e:
        tiny.generate("sort 907=", max_new_tokens=8, steps=10**9)
    assert e.value.param == "steps" and time.perf_counter() - t0 < 5


@pytest.mark.parametrize("family, kw, most", [("dream", {}, 512), ("llada", {"block_length": 4}, 8),
                                              ("llada2", {"block_length": 4}, 8)])
def test_every_family_has_the_bound(family, kw, most):
    """One step per new token, except Dream: its schedule changes with every step (a step may
    commit nothing), and the published default is 512 steps for 20 tokens, which stays allowed."""
    engine = MosaicEngine(random_model(family), {"progress": False})
    assert engine.request([5, 6, 7], max_new_tokens=8, steps=most, **kw).gen.steps == most
    with pytest.raises(InputError, match=f"at most {most}"):
        engine.request([5, 6, 7], max_new_tokens=8, steps=most + 1, **kw)


def test_a_default_above_the_canvas_is_capped(tiny):
    assert tiny.model.generation_defaults.get("steps") == 8
    out = tiny.generate("sort 907=", max_new_tokens=4)
    assert out.steps == 4 and out.config.steps == 4


def test_the_cli_refuses_with_one_error_line():
    r = subprocess.run([sys.executable, "-m", "mosaic", "generate", "--device", "cpu", "--steps", "64"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("error: --steps 64 is more than") and "at most 8" in r.stderr
