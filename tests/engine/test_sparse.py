"""Block-sparse attention in the engine: layouts chosen as configured, planned, and equal to
dense attention when every block is kept."""

import pytest
import torch
from conftest import random_model

from mosaic import MosaicEngine
from mosaic.config import SparseConfig, SparseRange, keep_count
from mosaic.errors import InputError
from mosaic.kernels.sparse_select import (
    block_means_into,
    block_minmax_into,
    bound_scores_into,
    row_bound_scores_into,
    select_into,
)


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


def test_minmax_scores_bound_the_largest_pooled_q_k_of_each_block():
    g = torch.Generator().manual_seed(1)
    hkv, n, hd, b = 2, 70, 8, 16                       # 5 key blocks, the last one of 6 keys
    k = torch.randn(n, hkv, hd, generator=g)
    q = torch.randn(hkv, 3, hd, generator=g)
    bounds = torch.empty(2, hkv, 5, hd)
    block_minmax_into(bounds, k, b)
    scores = torch.empty(hkv, 3, 5)
    bound_scores_into(scores, q.clone(), bounds)
    exact = torch.einsum("hqd,khd->hqk", q, k)
    blockmax = torch.stack([exact[..., j * b:(j + 1) * b].amax(-1) for j in range(5)], -1)
    assert (scores >= blockmax - 1e-5).all()
    single = torch.empty(2, hkv, 1, hd)                # one key: the bound is exact
    block_minmax_into(single, k[:1], b)
    one = torch.empty(hkv, 3, 1)
    bound_scores_into(one, q.clone(), single)
    torch.testing.assert_close(one[..., 0], exact[..., 0])


def test_a_single_matching_key_keeps_its_block_under_minmax_but_not_mean():
    """The copy-task failure (docs/CONFIG.md): one key that the query block matches (the copy
    source after its marker) among b filler keys. Block means dilute it b times and lose it to
    blocks whose filler happens to lean the query's way; the minmax bound keeps it."""
    g = torch.Generator().manual_seed(0)
    hkv, hd, b, nkb = 1, 32, 64, 16
    qdir = torch.randn(hd, generator=g)
    qdir /= qdir.norm()
    k = 0.2 * torch.randn(nkb * b, hkv, hd, generator=g)
    k[b * 8:b * 10] += 0.3 * qdir[:, None].T           # blocks 8, 9: filler leaning the query's way
    k[b * 5 + 17, 0] = 5 * qdir                        # the matching key, in key block 5
    q = (qdir * 3 + 0.1 * torch.randn(b, hd, generator=g))[:, None]   # one query block
    rng = SparseRange((0, 0), "topk", keep=2 / nkb, window=0, global_blocks=0)
    kt = keep_count(rng, nkb)
    kept = {}
    for est in ("mean", "minmax"):
        qpool, scores = torch.empty(hkv, 1, hd), torch.empty(hkv, 1, nkb)
        block_means_into(qpool, q, b)
        if est == "mean":
            kpool = torch.empty(hkv, nkb, hd)
            block_means_into(kpool, k, b)
            torch.bmm(qpool, kpool.transpose(1, 2), out=scores)
        else:
            kb = torch.empty(2, hkv, nkb, hd)
            block_minmax_into(kb, k, b)
            bound_scores_into(scores, qpool, kb)
        lay = select_into(scores, 12, rng, b, kt, torch.empty(hkv, 1, kt), torch.empty(hkv, 1, kt, dtype=torch.long),
                          torch.empty(hkv * kt, dtype=torch.int32), torch.empty(hkv, 2, dtype=torch.int32))
        kept[est] = set(lay.block_mask()[0, 0].nonzero().squeeze(1).tolist())
    assert 5 in kept["minmax"] and 5 not in kept["mean"]


def test_estimate_is_validated_and_defaults_to_minmax():
    assert SparseConfig().estimate == "minmax"
    with pytest.raises(InputError, match="estimate"):
        SparseConfig(estimate="max")


@pytest.mark.parametrize("family,estimate", [("llada", "minmax"), ("dream", "minmax"), ("llada", "mean")])
def test_keeping_every_block_equals_dense_attention(family, estimate):
    model = random_model(family)
    dense = gen(model, attention="triton")[1]
    everything = {"block": 16, "dense_steps": 0, "estimate": estimate,
                  "ranges": [{"layers": [0, 1], "pattern": "topk", "keep": 1.0}]}
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


def test_a_left_padded_row_gets_the_layout_of_the_same_prompt_alone(monkeypatch):
    """With a pad of whole blocks and one query chunk, the padded row's query blocks line up with
    its key blocks, so its layouts (window around its own key block) equal the prompt's alone.
    Before the fix the first chunk's window sat pad / block blocks too far right (q_block0
    clamped at 0 instead of -pad / block). (Query chunks that do not start on a block boundary
    pool other rows than the prompt alone: sparse layouts, unlike dense attention, may then
    differ between a padded row and the prompt alone.)"""
    import mosaic.graph.sparse_ops as ctx_mod
    seen = []
    real = ctx_mod.SS.select_into

    def spy(scores, q_block0, *a, **kw):
        lay = real(scores, q_block0, *a, **kw)
        seen.append(lay.indices.view(scores.shape[0], scores.shape[1], -1).clone())
        return lay

    monkeypatch.setattr(ctx_mod.SS, "select_into", spy)
    model = random_model("llada")
    g = torch.Generator().manual_seed(5)
    long_p = torch.randint(0, model.cfg.mask_id - 4, (80,), generator=g).tolist()
    short_p = long_p[32:]                                 # 48 tokens: padded by 32 = 2 blocks
    cfg = {"block": 16, "dense_steps": 0,
           "ranges": [{"layers": [0, 1], "pattern": "window", "window": 0, "global_blocks": 0}]}
    e = MosaicEngine(model, {"progress": False, "sparse": cfg, "chunks": (1, 1, 1)})   # one query chunk
    e.generate(short_p, max_new_tokens=16, steps=1)
    alone = seen[:2]                                      # layers 0, 1: [H, 4 query blocks, 1]
    seen.clear()
    pad = model.cfg.pad_id
    ids = torch.tensor([long_p, [pad] * 32 + short_p])   # one left-padded request of two rows
    mask = (torch.arange(80) >= torch.tensor([[0], [32]])).long()
    e.generate(inputs=ids, attention_mask=mask, max_new_tokens=16, steps=1)
    padded = seen[1::2]                                   # the second row's layouts, layers 0, 1
    assert len(alone) == len(padded) == 2
    for a, p in zip(alone, padded):
        assert torch.equal(p[:, 2:], a), (p, a)           # query blocks 2.. are the prompt's 0..


def test_row_bounds_keep_the_block_one_query_row_needs():
    """rows: one query row of a 16-row block matches a single key in a far block; pooled-query
    estimates let the other 15 rows (which match the first block) outvote it, the per-row bound
    keeps the far block in that query block's top 2 (with the forced block 0)."""
    g = torch.Generator().manual_seed(2)
    hd, b, nkb = 16, 16, 8
    k = torch.randn(nkb * b, 1, hd, generator=g) * 0.1
    q = torch.randn(b, 1, hd, generator=g) * 0.1
    k[5 * b + 7, 0] = 4.0 * torch.ones(hd)          # the needle, in key block 5
    q[3, 0] = 4.0 * torch.ones(hd)                  # the one row that needs it
    k[:b, 0] += 1.0                                  # block 0: what every other row prefers a bit
    q[torch.arange(b) != 3, 0] += 1.0
    bounds = torch.empty(2, 1, nkb, hd)
    block_minmax_into(bounds, k, b)
    rows = torch.empty(1, 1, nkb)
    row_bound_scores_into(rows, q, bounds, b)
    assert rows[0, 0].topk(2).indices.tolist().count(5) == 1
    # the bound is an upper bound of that row's real best q·k minus its best bound: <= 0, and 0 at its argmax
    assert rows.max() <= 0 and torch.isclose(rows.max(), torch.tensor(0.0))


def test_rows_estimate_with_every_block_equals_dense():
    model = random_model("dream")
    dense = gen(model, attention="triton")[1]
    cfg = {"block": 16, "dense_steps": 0, "estimate": "rows",
           "ranges": [{"layers": [0, 1], "pattern": "topk", "keep": 1.0}]}
    assert torch.equal(dense.tokens, gen(model, sparse=cfg)[1].tokens)
    assert SparseConfig(estimate="rows").estimate == "rows"
