"""The length the model was trained for: a request beyond it runs (the Python API keeps the
LengthWarning, once per engine) and says so in its Generation (`beyond_trained_length`); a
block-diffusion canvas is checked as the positions it runs, prompt + new tokens rounded up to
whole blocks (a 10-token prompt with 500 new tokens in blocks of 100 runs 600 positions: it was
checked as 510 and ran past a 512-position model without a word)."""

import warnings

import pytest
from conftest import random_model

from mosaic import LengthWarning, MosaicEngine
from mosaic.errors import InputError


def test_beyond_the_trained_length_is_flagged_in_the_generation():
    engine = MosaicEngine(random_model("llada", max_seq_len=16), {"progress": False})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        inside = engine.generate([1, 2, 3, 4], max_new_tokens=12, steps=2)
        beyond = engine.generate([1, 2, 3, 4], max_new_tokens=13, steps=1)
    assert not inside.beyond_trained_length and beyond.beyond_trained_length
    assert [type(w.message) for w in seen] == [LengthWarning]


def test_a_block_canvas_is_checked_as_the_positions_it_runs():
    engine = MosaicEngine(random_model("llada2", max_seq_len=512), {"progress": False})
    assert engine.sampler.positions(engine.generation_config(max_new_tokens=500, block_length=100), 10) == 600
    with pytest.warns(LengthWarning, match="510 tokens .run as 600 positions: whole blocks. is longer than"):
        request = engine.request([5] * 10, max_new_tokens=500, block_length=100, steps=1)
    assert request.positions == 600 and request.beyond_trained_length
    inside = engine.request([5] * 10, max_new_tokens=490, block_length=100, steps=1)
    assert inside.positions == 500 and not inside.beyond_trained_length
    capped = MosaicEngine(engine.model, {"progress": False, "max_length": 550})
    with pytest.raises(InputError, match="= 510 .run as 600 positions: whole blocks. exceeds max_length 550"):
        capped.request([5] * 10, max_new_tokens=500, block_length=100, steps=1)
