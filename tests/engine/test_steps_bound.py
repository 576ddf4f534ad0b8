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


@pytest.mark.parametrize("gen_length, block_length, steps", [(12, 4, 9), (16, 1, 16), (20, 4, 10), (8, 2, 8),
                                                             (4, 2, 4), (56, 7, 8)])
def test_a_default_is_rounded_up_to_whole_blocks(tiny, gen_length, block_length, steps):
    """generation_config.json's steps 8 used to be refused (`--gen-length 12 --block-length 4`:
    8 steps over 3 blocks) though the user never set steps: it runs the next multiple of the
    blocks, at most one per new token, and the run's config says so."""
    r = tiny.request("57+384=", max_new_tokens=gen_length, block_length=block_length)
    assert r.gen.steps == steps


def test_a_default_fits_the_blocks_through_generate_and_the_cli(tiny, capsys):
    import json

    from mosaic.cli import main
    out = tiny.generate("57+384=", max_new_tokens=12, block_length=4)
    assert out.steps == 9 and out.config.steps == 9
    assert main(["generate", "--device", "cpu", "--no-progress", "--prompt", "57+384=", "--gen-length", "12",
                 "--block-length", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 9


def test_given_steps_off_the_blocks_stay_refused(tiny):
    with pytest.raises(InputError, match="steps 8 must be a positive multiple of the number of blocks .3"):
        tiny.generate("57+384=", max_new_tokens=12, block_length=4, steps=8)


def test_a_cached_fast_dream_default_is_rounded_up_to_whole_blocks():
    dream = MosaicEngine("tiny-dream", {"device": "cpu", "progress": False})
    r = dream.request("sort 12=", max_new_tokens=12, block_length=4, cache="prefix")
    assert r.gen.steps == 9
