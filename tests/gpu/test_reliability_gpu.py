"""GPU parts of the reliability work (skipped without CUDA): the float16 temperature division and the NaN
check on the fused-kernel path, a budget above the card refused, `mosaic plan` defaulting to the
GPU, and tokens alone vs in a padded batch in bfloat16 (reported: bit-identity there depends on
cuBLAS choosing the same tilings for other row counts, docs/MODELS.md)."""

import json

import pytest
import torch
from conftest import bundled, left_padded, needs_cuda

from mosaic import MosaicEngine
from mosaic.cli import main
from mosaic.errors import InputError

pytestmark = [pytest.mark.gpu, needs_cuda]
PROMPTS = ["123+456=", "8+8=", "sort 907=", "57+384="]


@pytest.mark.parametrize("native", [False, True], ids=["planned", "native"])
def test_dream_float16_tiny_temperature_on_the_gpu(native):
    e = MosaicEngine(bundled("tiny-dream"), {"progress": False, "dtype": "float16", "native": native})
    out = e.generate("sort 907=", max_new_tokens=8, steps=8, temperature=1e-4, seed=0)
    assert out.text == "079"


def test_a_budget_above_the_card_is_refused():
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(InputError, match="more than the GPU"):
        MosaicEngine(bundled("tiny-llada"), {"progress": False, "memory_budget": total + 2**30})


def test_plan_defaults_to_cuda_on_a_gpu(capsys):
    assert main(["plan", "--model", "tiny-llada", "--budget", "2GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device"] == "cuda"


@pytest.mark.parametrize("name", ["tiny-dream", "tiny-llada"])
def test_alone_equals_padded_batch_in_bfloat16_on_the_gpu(name):
    e = MosaicEngine(bundled(name), {"progress": False, "dtype": "bfloat16"})
    inputs, mask = left_padded(e.model.cfg, e.encode(PROMPTS))       # one padded request of B rows
    together = e.generate(inputs=inputs, attention_mask=mask, max_new_tokens=8, steps=8).tokens
    assert torch.equal(e.generate(PROMPTS, max_new_tokens=8, steps=8).tokens, together)   # a batch of requests
    for i, p in enumerate(PROMPTS):
        assert torch.equal(e.generate(p, max_new_tokens=8, steps=8).tokens[0], together[i]), (name, i)
