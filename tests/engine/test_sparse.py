"""Block-sparse attention in the engine: layouts chosen as configured, planned, and equal to
dense attention when every block is kept."""

import pytest
import torch
from conftest import random_model

from mosaic import MosaicEngine
from mosaic.config import SparseRange, keep_count
from mosaic.kernels.sparse_select import select_into


def select(rng, h=2, nqb=4, nkb=8, q_block0=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(h, nqb, nkb, generator=g)
    kt = min(nkb, keep_count(rng, nkb))
    top_v, top_i = torch.empty(h, nqb, kt), torch.empty(h, nqb, kt, dtype=torch.long)
    idx, ptr = torch.empty(h * nqb * kt, dtype=torch.int32), torch.empty(h, nqb + 1, dtype=torch.int32)
    lay = select_into(scores.clone(), q_block0, rng, 16, kt, top_v, top_i, idx, ptr)
    return lay, scores


def test_window_keeps_the_local_and_global_blocks():
    lay, _ = select(SparseRange((0, 0), "global_local", window=1, global_blocks=1))
    mask = lay.block_mask()
    for i in range(4):
        c = min(2 + i, 7)
        want = {0} | {j for j in (c - 1, c, c + 1) if 0 <= j < 8}
        got = set(mask[0, i].nonzero().squeeze(1).tolist())
        assert want <= got and len(got) == keep_count(SparseRange((0, 0), "global_local"), 8)


def test_topk_keeps_the_highest_scores_beside_the_forced_blocks():
    rng = SparseRange((0, 0), "topk", keep=0.75, window=0, global_blocks=0)
    lay, scores = select(rng)
    mask = lay.block_mask()
    assert lay.density() == 0.75
    for h in range(2):
        for i in range(4):
            kept = scores[h, i][mask[h, i]]
            dropped = scores[h, i][~mask[h, i]]
            own = min(2 + i, 7)   # the diagonal block is always kept
            assert mask[h, i, own] and (dropped.max() <= kept.min() or scores[h, i, own] < dropped.max())


def gen(model, **engine):
    e = MosaicEngine(model, {"progress": False, "sanitize": True, **engine})
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.cfg.mask_id - 4, (70,), generator=g).tolist()
    return e, e.generate(prompt, max_new_tokens=12, steps=6)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_keeping_every_block_equals_dense_attention(family):
    model = random_model(family)
    dense = gen(model, attention="triton")[1]
    everything = {"block": 16, "dense_steps": 0, "ranges": [{"layers": [0, 1], "pattern": "topk", "keep": 1.0}]}
    sparse = gen(model, sparse=everything)[1]
    assert torch.equal(dense.tokens, sparse.tokens)


def test_sparse_steps_start_after_the_dense_ones_and_are_planned():
    model = random_model("llada")
    cfg = {"block": 16, "dense_steps": 2, "ranges": [{"layers": [0, 0], "pattern": "window", "window": 0},
                                                    {"layers": [1, 1], "pattern": "topk", "keep": 0.4}]}
    engine, out = gen(model, sparse=cfg, chunks=(3, 1, 1))
    sparse_keys = [s.key[8] is not None for s in engine.history]
    assert sparse_keys[:2] == [False, False] and all(sparse_keys[2:])
    assert out.tokens.shape == (1, 12) and any("block-sparse" in x for x in out.lossy)
