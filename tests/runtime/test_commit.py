"""The device-side commit rules (runtime/commit.py) against the published host rules
(runtime/commit_host.py, torch.topk per row): on random confidences with many ties, every row
that is not flagged tied is committed exactly as the host commits it, settle() (the device mask
plus the published call on tied rows) equals the host everywhere, and a row without equal values
is never flagged."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mosaic.runtime import commit as C
from mosaic.runtime import commit_host as H
from mosaic.runtime.published import topk_transfer
from mosaic.runtime.ties import topk_batch

INF = float("inf")
# few distinct values: ties at every cut; 0.8984375 is bfloat16(0.9), the threshold's own value
VALUES = [-INF, 0.0, 0.1, 0.25, 0.5, 0.75, 0.8984375, 0.9, 0.95, 1.0]
EXAMPLES = 120   # per rule: ~2 s each on one core; the tie-heavy values make every cut tied often
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@st.composite
def confidences(draw, distinct=False):
    B = draw(st.integers(1, 4))
    n = draw(st.integers(1, 40))
    dtype = draw(st.sampled_from(DTYPES))
    if distinct:
        vals = torch.randperm(n, generator=torch.Generator().manual_seed(draw(st.integers(0, 999)))).double() / n
        conf = torch.stack([vals.roll(j) for j in range(B)])
        holes = torch.tensor(draw(st.lists(st.booleans(), min_size=B * n, max_size=B * n))).view(B, n)
        conf = conf.masked_fill(holes, -INF)
    else:
        conf = torch.tensor(draw(st.lists(st.sampled_from(VALUES), min_size=B * n, max_size=B * n))).view(B, n)
    starts = draw(st.lists(st.integers(0, n - 1), min_size=B, max_size=B))
    for j, s in enumerate(starts):   # a left-padded row: its pads are never candidates
        conf[j, :s] = -INF
    return conf.to(dtype), (starts if any(starts) and draw(st.booleans()) else None)


def check(c: C.Commit, host: torch.Tensor):
    untied = ~c.tied
    assert torch.equal(c.mask[untied], host[untied])
    assert torch.equal(c.settle(), host)


@settings(max_examples=EXAMPLES, deadline=None)
@given(confidences(), st.sampled_from([0.05, 0.3, 0.5, 0.9, 0.95, 1.0]))
def test_threshold_equals_host(cs, threshold):
    conf, starts = cs
    check(C.commit_threshold(conf, threshold, starts), H.select_threshold(conf, threshold, starts))


def sorted_threshold(conf, threshold):
    """The threshold rule as a stable descending sort ranks it (commit.py before it took the
    max): mask [B, n], tied [B]."""
    srt, order = torch.sort(conf, dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(conf.shape[1]).expand_as(order))
    finite = torch.isfinite(conf)
    some = finite.any(1)
    mask = (finite & ~(conf < threshold)) | ((rank == 0) & some[:, None])
    tied = some & (srt[:, 0] < threshold) & ((conf == srt[:, :1]).sum(1) > 1)
    return mask, tied


@settings(max_examples=EXAMPLES, deadline=None)
@given(confidences(), st.sampled_from([0.05, 0.3, 0.5, 0.9, 0.95, 1.0]))
def test_threshold_without_a_sort_is_the_stable_orders_rule(cs, threshold):
    """The max's first index is the stable order's rank 0: the same mask on every row (tied rows
    included: what a caller that cannot read back commits) and the same tied rows."""
    conf, _ = cs
    c = C.commit_threshold(conf, threshold)
    mask, tied = sorted_threshold(conf, threshold)
    assert torch.equal(c.mask, mask) and torch.equal(c.tied, tied)


def test_threshold_ties_by_hand():
    conf = torch.tensor([[0.5, 0.7, 0.7, -INF], [0.95, 0.95, 0.2, 0.91], [-INF, -INF, -INF, -INF],
                         [0.3, 0.3, 0.3, 0.3]])
    c = C.commit_threshold(conf, 0.9)
    assert c.mask.tolist() == [[False, True, False, False], [True, True, False, True], [False] * 4,
                               [True, False, False, False]]
    assert c.tied.tolist() == [True, False, False, True]        # equal maxima below the threshold
    assert C.commit_threshold(conf[:, :0], 0.9).mask.shape == (4, 0)


@settings(max_examples=EXAMPLES, deadline=None)
@given(confidences(), st.sampled_from([0.1, 0.5, 1.0, 2.0, 3.7]))
def test_factor_equals_host(cs, factor):
    conf, starts = cs
    check(C.commit_factor(conf, factor, starts), H.select_factor(conf, factor, starts))


@settings(max_examples=EXAMPLES, deadline=None)
@given(confidences(), st.data())
def test_counts_equal_host_per_row(cs, data):
    """LLaDA's call: torch.topk per row, each row its own k (rows with different counts)."""
    conf, starts = cs
    k = [data.draw(st.integers(0, conf.shape[1] - (starts[j] if starts else 0))) for j in range(conf.shape[0])]
    check(C.commit_counts(conf, torch.tensor(k), starts), topk_transfer(conf, k, starts))


@settings(max_examples=EXAMPLES, deadline=None)
@given(confidences(), st.data())
def test_counts_equal_host_batched(cs, data):
    """Dream's call: one torch.topk over the batch with one k (ties.topk_batch)."""
    conf, starts = cs
    k = data.draw(st.integers(1, conf.shape[1] - max(starts or [0])))
    host = torch.zeros_like(conf, dtype=torch.bool).scatter_(1, topk_batch(conf, k, starts), True)
    check(C.commit_counts(conf, k, starts, batched=True), host)


@settings(max_examples=EXAMPLES, deadline=None)
@given(confidences(), st.data(), st.sampled_from([0.3, 0.9, 0.95, 1.0]))
def test_top_threshold_equals_host_and_counts_without_ties(cs, data, threshold):
    """Dream's uncached loop; its dropped count is read from the mask even on tied rows."""
    conf, starts = cs
    k = [data.draw(st.integers(0, int(torch.isfinite(conf[j]).sum()))) for j in range(conf.shape[0])]
    c = C.commit_top_threshold(conf, torch.tensor(k), threshold, starts)
    host = H.select_top_threshold(conf, k, threshold, starts)
    check(c, host)
    assert torch.equal(c.mask.sum(1), host.sum(1))


@settings(max_examples=EXAMPLES, deadline=None)
@given(confidences(), st.data(), st.sampled_from([0.3, 0.9, 0.95, 1.0]))
def test_llada2_equals_host(cs, data, threshold):
    conf, _ = cs
    k = data.draw(st.lists(st.integers(0, conf.shape[1]), min_size=conf.shape[0], max_size=conf.shape[0]))
    check(C.commit_llada2(conf, torch.tensor(k), threshold), H.select_llada2(conf, k, threshold))


@settings(max_examples=EXAMPLES // 2, deadline=None)
@given(confidences(distinct=True), st.data())
def test_distinct_values_are_never_tied(cs, data):
    conf, starts = cs
    k = data.draw(st.integers(0, int(torch.isfinite(conf).sum(1).min())))
    for c in (C.commit_threshold(conf, 0.5, starts), C.commit_factor(conf, 1.0, starts),
              C.commit_counts(conf, k, starts), C.commit_llada2(conf, k, 0.5)):
        assert not c.tied.any()


def test_allowed_mask_composes():
    conf = torch.tensor([[0.95, 0.5, 0.91, 0.2]])
    allowed = torch.tensor([[False, True, True, True]])
    masked = conf.masked_fill(~allowed, -INF)
    for dev, host in ((C.commit_threshold(conf, 0.9, allowed=allowed), H.select_threshold(masked, 0.9)),
                      (C.commit_factor(conf, 1.0, allowed=allowed), H.select_factor(masked, 1.0)),
                      (C.commit_counts(conf, 2, allowed=allowed), topk_transfer(masked, [2]))):
        assert torch.equal(dev.settle(), host) and not dev.mask[0, 0]


def test_rows_without_candidates_commit_nothing():
    conf = torch.tensor([[-INF, -INF, -INF], [0.2, -INF, 0.9]])
    for c in (C.commit_threshold(conf, 0.5), C.commit_factor(conf, 1.0), C.commit_llada2(conf, 2, 0.5)):
        assert not c.mask[0].any() and not c.tied[0]
    assert C.commit_threshold(conf, 0.5).mask[1].tolist() == [False, False, True]


@pytest.mark.parametrize("tie", [False, True])
def test_apply_reads_back_once_and_fixes_tied_rows(tie):
    conf = torch.tensor([[0.5, 0.5 if tie else 0.4, 0.1], [0.9, 0.2, -INF]])
    x = torch.full((2, 3), 9)
    x0 = torch.tensor([[1, 2, 3], [4, 5, 6]])
    c = C.commit_counts(conf, 1)
    got = C.apply(x, x0, c, lambda: (x == 9).sum(1)[None])
    want = torch.where(topk_transfer(conf, [1, 1]), x0, 9)
    assert torch.equal(x, want) and got == [(want == 9).sum(1).tolist()]
    assert bool(c.tied[0]) == tie
