"""The recall measurement against a dense reference: exact block mass, keep 1.0 keeps it all,
a window misses a far peak that a top-k estimate finds, entropy bounds."""

import math

import pytest
import torch

from mosaic.policy.sparse_recall import (
    Candidate,
    attention_stats,
    block_entropy,
    block_mass,
    block_scores,
    kept_blocks,
    key_estimate,
    recall,
)


def _qk(nq=96, nk=96, hq=4, hkv=2, hd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nq, hq, hd, generator=g), torch.randn(nk, hkv, hd, generator=g)


def test_block_mass_is_the_dense_softmax_summed_per_block():
    q, k = _qk(nk=88)                                    # a partial last block of 8 keys
    mass = block_mass(q, k, 16)
    kk = k.repeat_interleave(2, dim=1)                   # query head h reads key head h // 2
    p = torch.softmax(torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(8), -1)
    want = torch.nn.functional.pad(p, (0, 8)).view(4, 96, 6, 16).sum(-1)
    assert torch.allclose(mass, want, atol=1e-6)
    assert torch.allclose(mass.sum(-1), torch.ones(4, 96), atol=1e-5)


@pytest.mark.parametrize("estimate", ["minmax", "rows", "mean"])
def test_keep_one_and_dense_keep_all_the_mass(estimate):
    q, k = _qk()
    mass = block_mass(q, k, 16)
    scores = block_scores(q, key_estimate(k, 16, estimate), 16, estimate)
    for cand in (Candidate("dense"), Candidate("topk", 1.0)):
        assert torch.allclose(recall(mass, kept_blocks(scores, cand, 16), 16), torch.ones(4, 96), atol=1e-5)
    part = recall(mass, kept_blocks(scores, Candidate("topk", 0.2), 16), 16)
    assert float(part.max()) < 1 - 1e-3                  # 4 of 6 blocks: something is lost


def _far_peak(nq=128, nk=128, hd=8, far=7):
    """Every query matches only the keys of key block `far` (16 keys a block)."""
    q = torch.zeros(nq, 1, hd)
    q[:, 0, 0] = 8.0
    k = torch.zeros(nk, 1, hd)
    k[far * 16:(far + 1) * 16, 0, 0] = 8.0
    return q, k


def test_a_window_misses_a_far_peak_that_topk_finds():
    q, k = _far_peak()
    mass = block_mass(q, k, 16)
    scores = block_scores(q, key_estimate(k, 16, "minmax"), 16, "minmax")
    win = recall(mass, kept_blocks(scores, Candidate("window", window=1), 16), 16)
    top = recall(mass, kept_blocks(scores, Candidate("topk", 0.25, window=0, global_blocks=0), 16), 16)
    assert float(win[:, :16 * 5].max()) < 0.05           # query blocks 0-4 do not reach block 7
    assert float(top.min()) > 0.99                       # its own block and the right one
    # the mass is all in block 7: the exact measure, whatever the estimate
    assert torch.allclose(mass[..., 7], torch.ones(1, 128), atol=1e-5)


def test_entropy_is_zero_for_one_block_and_one_for_uniform():
    q, k = _far_peak()
    assert float(block_entropy(block_mass(q, k, 16))[0]) < 1e-4
    assert float(block_entropy(block_mass(torch.zeros(32, 1, 8), torch.zeros(128, 1, 8), 16))[0]) == \
        pytest.approx(1.0, abs=1e-5)


def test_attention_stats_sums_over_rows_and_masked_rows():
    q, k = _qk()
    rows = torch.tensor([90, 91, 95])
    st = attention_stats(q, k, 16, (Candidate("dense"), Candidate("topk", 0.2)), ("minmax",), rows)
    assert st["rows"] == 96 and st["masked_rows"] == 3
    assert torch.allclose(st[("minmax", "dense")]["all"], torch.full((4,), 96.0), atol=1e-3)
    assert torch.allclose(st[("minmax", "dense")]["masked"], torch.full((4,), 3.0), atol=1e-4)
    assert float(st[("minmax", "topk 0.2")]["all"].max()) < 96


def test_candidate_density_and_label():
    assert Candidate("topk", 0.1).density(1024) == pytest.approx(103 / 1024)
    assert Candidate("window", window=1).density(1024) == pytest.approx(3 / 1024 + 1 / 1024)  # + global 1
    assert Candidate("dense").density(8) == 1.0
    assert Candidate("global_local", window=4, global_blocks=4).label == "global_local 4+4"
