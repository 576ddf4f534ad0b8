"""A planned step's NaN test waits on the device for the step's one readback
(runtime/published.defer_check, read by commit.apply or at the StepDone): the request still
fails with NumericsError before its first StepDone, and nothing is left for the next request."""

import pytest
import torch
from conftest import random_model

from mosaic import MosaicEngine
from mosaic.errors import NumericsError
from mosaic.runtime import published as P


def test_readback_carries_the_pending_tests():
    P.clear_checks()
    t = torch.tensor([[1, 2], [3, 4]])
    P.defer_check(torch.tensor([0.5, 0.25]), torch.float32)
    assert P.read_with_checks(t) == [[1, 2], [3, 4]]                      # read, passed, cleared
    P.defer_check(torch.tensor([0.5, float("nan")]), torch.float16)
    with pytest.raises(NumericsError, match="NaN in float16"):
        P.read_with_checks(t)
    P.settle_checks()                                                      # nothing left pending
    P.defer_check(torch.tensor([float("nan")]), torch.bfloat16)
    with pytest.raises(NumericsError, match="bfloat16"):
        P.settle_checks()
    P.defer_check(torch.tensor([float("nan")]), torch.bfloat16)
    P.clear_checks()
    P.settle_checks()


@pytest.mark.parametrize("options", [dict(), dict(cache="dual", threshold=0.9, block_length=4)])
def test_nan_probabilities_fail_the_request_before_any_step(options):
    model = random_model("llada", dtype=torch.float16)
    model.lm_head.mul_(6e4)                                                # logits overflow float16
    e = MosaicEngine(model, {"progress": False})
    steps = []
    with pytest.raises(NumericsError, match="NaN in float16"):
        e.generate([1, 2, 3], max_new_tokens=8, steps=8, on_step=lambda *a: steps.append(a), **options)
    assert steps == []
    model.lm_head.div_(6e4)
    e.generate([1, 2, 3], max_new_tokens=8, steps=8, **options)           # the next request is clean


@pytest.mark.parametrize("counts", [(3, 0, 2, 1), (2, 2, 2), (4,), (1, 3)])
def test_a_stacked_steps_test_is_split_per_request(counts):
    """published.segment_nan: one flag per request, over its own rows only, on the device."""
    for bad in range(sum(counts)):
        conf = torch.rand(sum(counts), dtype=torch.float64)
        conf[bad] = float("nan")
        flags = P.segment_nan(conf, counts)
        owner = next(i for i in range(len(counts)) if bad < sum(counts[:i + 1]))
        assert flags.dtype == torch.bool and flags.tolist() == [i == owner for i in range(len(counts))]
    assert not P.segment_nan(torch.rand(sum(counts)), counts).any()
    assert P.segment_nan(torch.zeros(sum(counts), dtype=torch.long), counts) is None
