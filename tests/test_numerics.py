"""Numerics that fail loudly: Dream's logits / temperature is taken in float32 where float16
overflows (every token came out id 0), identical to the reference's division wherever that is
finite, and NaN probabilities raise NumericsError before a token is committed."""

import pytest
import torch
from conftest import bundled

from mosaic import MosaicEngine
from mosaic.errors import NumericsError
from mosaic.runtime import published as P


@pytest.mark.parametrize("native", [False, True], ids=["planned", "native"])
def test_dream_float16_tiny_temperature_is_not_all_zeros(native):
    e = MosaicEngine(bundled("tiny-dream"), {"progress": False, "dtype": "float16", "native": native})
    greedy = e.generate("sort 907=", max_new_tokens=8, steps=8)
    hot = e.generate("sort 907=", max_new_tokens=8, steps=8, temperature=1e-4, seed=0)
    assert hot.text == greedy.text == "079"


def test_scale_logits_is_the_reference_division_where_finite():
    g = torch.Generator().manual_seed(0)
    lg = (torch.randn(6, 30, generator=g) * 4).half()
    assert torch.equal(P.scale_logits(lg, 0.7), lg / 0.7) and P.scale_logits(lg, 0.7).dtype == torch.float16
    big = P.scale_logits(lg, 1e-4)
    assert big.dtype == torch.float32 and bool(torch.isfinite(big).all())
    assert torch.equal(big.argmax(-1), lg.float().argmax(-1))


def test_nan_probabilities_raise_before_any_commit():
    lg = torch.zeros(3, 8, dtype=torch.float16)
    lg[1, 2] = float("nan")
    with pytest.raises(NumericsError, match="NaN in float16"):
        P.sample_tokens(lg)
    with pytest.raises(NumericsError):
        P.llada_confidence(lg, lg.argmax(-1), "model")
    conf, _ = P.sample_tokens(torch.zeros(3, 8))          # finite: no error
    assert bool(torch.isfinite(conf).all())
