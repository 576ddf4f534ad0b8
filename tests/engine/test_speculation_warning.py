"""Speculation is warned about where it is known to be slower: on a GPU past ~256 canvas rows a
verification of K canvases costs about K steps (reported on an H200: 130 ms per verification for
1.45 tokens at K = 4 on the llada-8b preset, 11.2 vs 28.3 tokens/s step by step). The README's
"2.4 tokens per forward" read as a speed-up everywhere. The GPU case runs in tests/gpu."""

import warnings

from mosaic import MosaicEngine, SpeculationWarning
from mosaic.engine.checks import COMPUTE_BOUND_ROWS, speculation_slower


def test_the_rule():
    assert speculation_slower("cuda", COMPUTE_BOUND_ROWS + 1, 4) and "about 4 steps" in \
        speculation_slower("cuda", 1280, 4)
    assert speculation_slower("cuda", COMPUTE_BOUND_ROWS, 4) is None      # weight-bound: it may pay
    assert speculation_slower("cuda", 1280, 0) is None                     # no speculation
    assert speculation_slower("cpu", 1280, 4) is None                      # measured to pay on the bundled models


def test_no_warning_where_it_pays():
    engine = MosaicEngine("tiny-llada", {"device": "cpu", "progress": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpeculationWarning)
        out = engine.generate("sort 31415926=", max_new_tokens=8, steps=8, speculate=4)
    assert out.text == "11234569"
