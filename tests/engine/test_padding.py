"""Every family gives each prompt the same tokens alone and in any left-padded batch (one request
of B rows: generate(inputs=ids, attention_mask=mask)), on the native and the planned path
(LLaDA-MoE included, where Mosaic masks the padded keys that the published code attends to:
docs/MODELS.md), and in a list of prompts (a batch of requests)."""

import pytest
import torch
from conftest import left_padded, random_model

from mosaic import MosaicEngine

KW = {"llada": dict(max_new_tokens=8, steps=8, block_length=4),
      "llada_moe": dict(max_new_tokens=8, steps=8),
      "dream": dict(max_new_tokens=8, steps=4, alg="entropy")}


def prompts(cfg, lengths, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.mask_id - 4, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("native", [True, False], ids=["native", "planned"])
def test_tokens_alone_equal_tokens_in_a_padded_batch(family, native):
    model = random_model(family)
    engine = MosaicEngine(model, {"progress": False, "native": native})
    batch = prompts(model.cfg, (5, 11, 8, 3))
    ids, mask = left_padded(model.cfg, batch)
    together = engine.generate(inputs=ids, attention_mask=mask, **KW[family]).tokens
    for i, p in enumerate(batch):
        alone = engine.generate(p, **KW[family]).tokens[0]
        assert torch.equal(alone, together[i]), (family, i)
    # the batch-mates change: the answer does not
    ids, mask = left_padded(model.cfg, [batch[1], prompts(model.cfg, (13,), seed=9)[0]])
    other = engine.generate(inputs=ids, attention_mask=mask, **KW[family]).tokens
    assert torch.equal(other[0], together[1])
    assert torch.equal(engine.generate(batch, **KW[family]).tokens, together)     # a batch of requests


def test_moe_padded_keys_are_masked():
    """Without the mask (the published behaviour) a padded row's logits would depend on its pads."""
    model = random_model("llada_moe")
    engine = MosaicEngine(model, {"progress": False})
    ids = torch.tensor([[41, 41, 41, 5, 6, 7], [1, 2, 3, 4, 5, 6]])
    valid = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6]).bool()
    masked = engine.forward_logits(ids, valid)
    ids2 = ids.clone()
    ids2[0, :3] = torch.tensor([9, 10, 11])          # other pad contents: same real-row logits
    assert torch.allclose(engine.forward_logits(ids2, valid)[0, 3:], masked[0, 3:], atol=1e-6)
    unmasked = engine.forward_logits(ids, None)
    assert not torch.allclose(unmasked[0, 3:], masked[0, 3:], atol=1e-3)
