"""Hand-checked cases of the published samplers' semantics."""

import pytest
import torch

from mosaic.runtime import published as P
from mosaic.runtime.reducers import NoiseStream


def test_transfer_schedule_splits_remainder_to_first_steps():
    block_mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    assert P.num_transfer_tokens(block_mask, 2).tolist() == [[3, 2], [2, 1]]
    assert P.num_transfer_tokens(block_mask, 4).tolist() == [[2, 1, 1, 1], [1, 1, 1, 0]]


def test_topk_ranks_the_full_length_vector():
    conf = torch.tensor([[0.5, -torch.inf, 0.9, 0.5, 0.1], [0.3, 0.3, 0.3, -torch.inf, 0.2]])
    t = P.topk_transfer(conf, [2, 2])
    assert t[0].tolist() == [True, False, True, False, False] or t[0].tolist() == [
        False, False, True, True, False]  # the tie (0.5, 0.5) goes as torch.topk decides ...
    _, ref = torch.topk(conf[0], 2)  # ... and that decision is reproduced exactly
    assert set(torch.nonzero(t[0]).squeeze(1).tolist()) == set(ref.tolist())
    _, ref1 = torch.topk(conf[1], 2)
    assert set(torch.nonzero(t[1]).squeeze(1).tolist()) == set(ref1.tolist())


def test_dream_transfer_counts_in_float32():
    steps = 16
    ts = torch.linspace(1, 1e-3, steps + 1)
    masked = torch.tensor(16) / 1  # mean masked count over the batch, a float tensor
    assert P.dream_transfer_count(masked, ts[0], ts[1], False) == 0  # 16 * 0.0624375 -> 0
    assert P.dream_transfer_count(masked, ts[14], ts[15], True) == 16


def test_cfg_formula():
    cond, un = torch.randn(3, 7), torch.randn(3, 7)
    expect = un + (1.5 + 1) * (cond - un)
    assert torch.equal(P.cfg_combine(cond.clone(), un, 1.5), expect)


def test_gumbel_max_in_float64():
    logits = torch.randn(4, 9)
    u = torch.rand(4, 9, dtype=torch.float64)
    got = P.add_gumbel_noise(logits, 0.7, noise=u.clone())
    expect = logits.to(torch.float64).exp() / (-torch.log(u)) ** 0.7
    assert torch.equal(got, expect)
    assert P.add_gumbel_noise(logits, 0.0) is logits


def test_noise_stream_reproduces_one_full_draw():
    g = torch.Generator().manual_seed(5)
    full = torch.rand(2, 6, 11, dtype=torch.float64, generator=g)
    after = torch.rand(3, generator=g)
    g2 = torch.Generator().manual_seed(5)
    s = NoiseStream(12, 11, g2, torch.device("cpu"), piece=2)
    rows = s.rows([1, 2, 7]) , s.rows([9])
    s.finish()
    assert torch.equal(rows[0], full.view(12, 11)[[1, 2, 7]])
    assert torch.equal(rows[1], full.view(12, 11)[[9]])
    assert torch.equal(torch.rand(3, generator=g2), after)  # the stream continues in step


def test_llada_confidence_variants():
    logits = torch.randn(2, 5, 13).bfloat16()
    x0 = logits.argmax(-1)
    bf = P.llada_confidence(logits, x0, "model")
    f64 = P.llada_confidence(logits, x0, "float64")
    assert bf.dtype == torch.bfloat16 and f64.dtype == torch.float64
    assert torch.allclose(bf.double(), f64, atol=1e-2)


def test_sample_tokens_margin_and_entropy():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    p = torch.softmax(logits, -1)
    conf, x0 = P.sample_tokens(logits, margin_confidence=True)
    assert x0.tolist() == [0, 2]
    assert torch.allclose(conf, p.sort(-1, descending=True).values[:, 0] - p.sort(-1, descending=True).values[:, 1])
    conf, _ = P.sample_tokens(logits, neg_entropy=True)
    assert torch.allclose(conf, (p * torch.log(p + 1e-10)).sum(-1))
    assert conf[1] > conf[0]  # the peaked row is the more confident one


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_margin_from_the_top_two_equals_the_references_sort_bit_for_bit(dtype):
    """topk_margin's confidence takes the two largest probabilities with topk (no [M, V] sort
    buffers): the same two numbers as the reference's descending sort, ties and top-p/top-k
    filtered rows (many equal minima) included."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 97, generator=g).to(dtype)
    logits[:8, :5] = logits[:8, :1]                        # tied maxima
    logits[8:16] = torch.round(logits[8:16])               # many ties everywhere
    for kw in ({}, {"temperature": 0.7, "top_p": 0.9}, {"temperature": 0.7, "top_k": 5}):
        torch.manual_seed(1)
        conf, _ = P.sample_tokens(logits, margin_confidence=True, **kw)
        f = logits / kw["temperature"] if kw else logits
        if "top_p" in kw:
            f = P.top_p_logits(f, kw["top_p"])
        if "top_k" in kw:
            f = P.top_k_logits(f, kw["top_k"])
        ref = torch.sort(torch.softmax(f, dim=-1), dim=-1, descending=True)[0]
        assert torch.equal(conf, ref[:, 0] - ref[:, 1])


def test_top_p_keeps_the_first_token_above_threshold():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = P.top_p_logits(logits, 0.7) > torch.finfo(torch.float32).min
    assert kept.tolist() == [[True, True, False, False]]
    kept = P.top_k_logits(logits, 3) > torch.finfo(torch.float32).min
    assert kept.tolist() == [[True, True, True, False]]
