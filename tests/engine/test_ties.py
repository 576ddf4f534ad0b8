"""Ties among equal confidences are broken from each row's first real token (runtime/ties.py):
a prompt gets the same tokens alone and in a left-padded batch in bfloat16 and float16 too, where
many confidences round to exactly 1.0 (tiny-dream "8+8=" beside "123+456=" gave 1688, alone
1668), while an unpadded row is ranked on its full row exactly as the published torch.topk call."""

import pytest
import torch
from conftest import bundled, random_model

from mosaic import MosaicEngine
from mosaic.runtime.ties import row_starts, topk, topk_batch

PROMPTS = ["123+456=", "8+8=", "sort 907=", "57+384=", "9+9=", "sort 5551="]


def _alone_equals_batch(engine, batch, **kw):
    together = engine.generate(batch, **kw).tokens
    for i, p in enumerate(batch):
        alone = engine.generate(p, **kw).tokens[0]
        assert torch.equal(alone, together[i]), (i, alone.tolist(), together[i].tolist())


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["tiny-dream", "tiny-llada"])
@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["planned", "native"])
def test_bundled_alone_equals_padded_batch_in_low_precision(name, dtype, native):
    engine = MosaicEngine(bundled(name), {"progress": False, "dtype": dtype, "native": native})
    _alone_equals_batch(engine, PROMPTS, max_new_tokens=8, steps=8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_alone_equals_padded_batch_in_low_precision(dtype):
    model = random_model("llada_moe", dtype=dtype)
    engine = MosaicEngine(model, {"progress": False})
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(0, model.cfg.mask_id - 4, (n,), generator=g).tolist() for n in (3, 9, 5, 12)]
    _alone_equals_batch(engine, batch, max_new_tokens=8, steps=4)


@pytest.mark.parametrize("options", [dict(threshold=0.9), dict(factor=1.0), dict(cache="dual", threshold=0.9)],
                         ids=["threshold", "factor", "dual"])
def test_fast_llada_alone_equals_padded_batch_in_bfloat16(options):
    engine = MosaicEngine(bundled("tiny-llada"), {"progress": False, "dtype": "bfloat16"})
    _alone_equals_batch(engine, PROMPTS, max_new_tokens=8, steps=8, block_length=4, **options)


def test_unpadded_rows_rank_exactly_as_torch_topk():
    conf = torch.tensor([[1.0, 1.0, 0.5, 1.0, -torch.inf], [0.2, 1.0, 1.0, 1.0, 1.0]])
    assert torch.equal(topk_batch(conf, 2, None), torch.topk(conf, 2).indices)
    assert row_starts(torch.ones(2, 5, dtype=torch.bool)) is None


def test_padded_rows_rank_as_alone():
    alone = torch.tensor([1.0, 1.0, 0.25, 1.0, 1.0, 1.0, 1.0])
    padded = torch.cat([torch.full((3,), -torch.inf), alone])
    _, want = torch.topk(alone, 3)
    assert torch.equal(topk(padded, 3, 3)[1], want + 3)
    valid = torch.tensor([[False] * 3 + [True] * 7, [True] * 10])
    assert row_starts(valid) == [3, 0]
    both = torch.stack([padded, torch.cat([alone, torch.zeros(3)])])
    got = topk_batch(both, 3, row_starts(valid))
    assert torch.equal(got[0], want + 3) and torch.equal(got[1], torch.topk(both[1:], 3).indices[0])
