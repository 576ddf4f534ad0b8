"""The commit rules on the device: which positions a denoising step commits, for every row at once.

The rules are the published ones (runtime/commit_host.py states them and runs them row by row,
as the published code does): `counts` (the k most confident), `threshold`, Fast-dLLM's `factor`,
LLaDA2's threshold-or-top-k. Here each is a handful of tensor ops over confidences conf [B, n]
(-inf where a position is not a candidate) with no host read: one stable descending sort per row
gives every position's rank and the k-th value, and the rule is a comparison against them.

Exactness, ties included. Where no tie decides, what a rule commits is a function of the values
alone, so the device mask equals the published call's. The published calls use torch.topk, whose
choice among equal values is its implementation's (libstdc++'s introselect / partial sort on the
CPU, a radix select then a bitonic sort of <= 32 values on CUDA): no vectorised rule reproduces it
on both. So each rule also returns `tied` [B]: the rows where equal confidences straddle the cut
(the k-th value occurs outside the top k; for the threshold rule, a tied maximum below the
threshold). For those rows `exact(rows)` runs the published call (commit_host.py); `apply` below
does that after the step's one readback, only when a row is tied. In float64 (LLaDA's Fast-dLLM
confidences) ties essentially never occur; in bfloat16 they do (many probabilities round to 1.0).
The mask of a tied row is the stable order's (equal values by position), which a caller that
cannot read back (a captured graph) may use, labelled.

`allowed` [B, n] bool (optional, every rule): positions outside it are not candidates (constrained
decoding composes here: it sets what may be committed, the rule decides what is)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from . import commit_host as H
from . import published as P
from .published import topk_transfer
from .readback import Readback
from .ties import topk_batch


@dataclass(frozen=True)
class Commit:
    """What a rule commits: mask [B, n] bool (exact on every row that is not tied), tied [B] bool
    (rows a tie decides), exact(rows) -> [len(rows), n] bool (the published call on those rows)."""
    mask: torch.Tensor
    tied: torch.Tensor
    exact: Callable[[list[int]], torch.Tensor]

    def settle(self) -> torch.Tensor:
        """The published rule's mask [B, n]: reads `tied` (one host read) and runs the published
        call on the rows a tie decides."""
        P.settle_checks()   # a pending NaN test of the step raises first (runtime/published.py)
        rows = self.tied.nonzero().squeeze(1).tolist()
        if not rows:
            return self.mask
        out = self.mask.clone()
        out[torch.tensor(rows, device=out.device)] = self.exact(rows)
        return out


def _prepare(conf: torch.Tensor, allowed: torch.Tensor | None):
    """(conf with -inf outside allowed, its values sorted descending per row [B, n], the stable
    rank of every position [B, n]: equal values ranked by position)."""
    if allowed is not None:
        conf = conf.masked_fill(~allowed, -torch.inf)
    srt, order = torch.sort(conf, dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(conf.shape[1], device=conf.device).expand_as(order))
    return conf, srt, rank


def _as_counts(counts, B: int, device) -> torch.Tensor:
    """counts (an int, a 0-d tensor or [B]) as a [B] int64 tensor on device."""
    c = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts)
    return c.to(device=device, dtype=torch.int64).reshape(-1).expand(B)


def _top(conf, srt, rank, c):
    """(mask [B, n]: the c[j] most confident of each row in the stable order, tied [B]: rows where
    the c-th value also occurs outside the top c)."""
    n = conf.shape[1]
    c = c.clamp(0, n)
    if n == 0:
        return rank.bool(), c > 0
    kth = srt.gather(1, (c - 1).clamp(min=0)[:, None])
    tied = (c > 0) & ((conf >= kth).sum(1) > c)
    return rank < c[:, None], tied


def _rows(starts, rows):
    return [starts[j] for j in rows] if starts else None


def commit_counts(conf: torch.Tensor, counts, starts: list[int] | None = None, allowed: torch.Tensor | None = None,
                  batched: bool = False) -> Commit:
    """The counts[j] most confident positions of each row (counts: int, 0-d or [B] tensor). The
    published call: torch.topk per row (LLaDA's generate.py), or one torch.topk over the batch
    with one k (batched: Dream's generation_utils.py; ties.topk_batch)."""
    conf, srt, rank = _prepare(conf, allowed)
    c = _as_counts(counts, conf.shape[0], conf.device)
    mask, tied = _top(conf, srt, rank, c)

    def exact(rows):
        if batched:    # the published call is over the whole batch: take its rows
            k = int(c[0])
            out = torch.zeros_like(conf, dtype=torch.bool)
            if k > 0:
                idx = topk_batch(conf, k, starts)
                out.scatter_(1, idx, True)
            return out[torch.tensor(rows, device=conf.device)]
        sub = torch.tensor(rows, device=conf.device)
        return topk_transfer(conf[sub], c[sub].tolist(), _rows(starts, rows))
    return Commit(mask, tied, exact)


def commit_threshold(conf: torch.Tensor, threshold: float, starts: list[int] | None = None,
                     allowed: torch.Tensor | None = None) -> Commit:
    """Per row the most confident candidate and every candidate with conf >= threshold (compared
    in conf's dtype, as published: `~(conf < threshold)`). No sort (the rule needs no rank but
    the first): the top candidate is the row's max, at its first position among equal values
    (torch.max's index, the stable order's rank 0); a tie decides only where equal maxima lie
    below the threshold (which one is committed is torch.topk's choice). A step's commit is on
    every request's path: a sort is ~10 more ATen calls, and on CUDA several kernels."""
    if allowed is not None:
        conf = conf.masked_fill(~allowed, -torch.inf)
    B, n = conf.shape
    if n == 0:
        none = conf.new_zeros(B, dtype=torch.bool)
        return Commit(conf.new_zeros(B, 0, dtype=torch.bool), none, lambda rows: conf.new_zeros(len(rows), 0,
                                                                                               dtype=torch.bool))
    top, first = conf.max(1)
    some = top > -torch.inf                                 # a candidate (conf is -inf elsewhere)
    # >= is the published ~(<) on every candidate (a probability is never +inf; NaN ones fail the step)
    mask = (conf >= threshold).scatter_(1, first[:, None], some[:, None])
    tied = some & (top < threshold) & ((conf == top[:, None]).sum(1) > 1)
    return Commit(mask, tied, lambda rows: H.select_threshold(conf[_index(rows, conf)], threshold, _rows(starts, rows)))


@lru_cache(maxsize=64)
def _factor_thresholds(factor: float, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n]: the factor rule's bar per rank, -1 then 1 - factor / (r + 2) for r = 1, 2, ... (the
    published list, in Python floats, rounded to conf's dtype as its scalar comparisons do)."""
    return torch.tensor([-1.0] + [1 - factor / (r + 1) for r in range(2, n + 1)], dtype=torch.float64) \
        .to(dtype=dtype, device=device)


def commit_factor(conf: torch.Tensor, factor: float, starts: list[int] | None = None,
                  allowed: torch.Tensor | None = None) -> Commit:
    """Fast-dLLM's factor rule (commit_host.py): the count is the first rank r whose value is
    below its bar (1 when r = 0, every candidate when r is the last rank or none fails), then the
    count most confident."""
    conf, srt, rank = _prepare(conf, allowed)
    B, n = conf.shape
    K = torch.isfinite(conf).sum(1)
    r = torch.arange(n, device=conf.device)
    fail = (srt < _factor_thresholds(float(factor), n, conf.dtype, conf.device)) & (r < K[:, None])
    first = torch.where(fail, r, n).min(1).values if n else K
    top = torch.where(first < n, first, K - 1)
    top = torch.where((top == 0) | (top == K - 1), top + 1, top)
    mask, tied = _top(conf, srt, rank, torch.where(K > 0, top, 0))
    return Commit(mask, tied, lambda rows: H.select_factor(conf[_index(rows, conf)], factor, _rows(starts, rows)))


def commit_top_threshold(conf: torch.Tensor, counts, threshold: float, starts: list[int] | None = None,
                         allowed: torch.Tensor | None = None) -> Commit:
    """Dream's uncached threshold loop: of each row's counts[j] most confident, the first and every
    other one with conf >= threshold. The count committed does not depend on ties (equal values
    pass or fail together), so mask.sum(1) is exact on tied rows too."""
    conf, srt, rank = _prepare(conf, allowed)
    c = _as_counts(counts, conf.shape[0], conf.device)
    top, tied = _top(conf, srt, rank, c)
    on = c > 0
    first = (rank == 0) & on[:, None]
    if conf.shape[1]:
        tied = tied | (on & (srt[:, 0] < threshold) & ((conf == srt[:, :1]).sum(1) > 1))
    return Commit((top & ~(conf < threshold)) | first, tied,
                  lambda rows: H.select_top_threshold(conf[_index(rows, conf)], c[_index(rows, conf)].tolist(),
                                                      threshold, _rows(starts, rows)))


def commit_llada2(conf: torch.Tensor, counts, threshold: float, allowed: torch.Tensor | None = None,
                  clamp: bool = True) -> Commit:
    """LLaDA2's rule per row with a candidate: every candidate with conf > threshold when there
    are at least counts[j] of them, else the min(counts[j], candidates) most confident (clamp;
    else counts[j] positions, SDAR's: past the candidates torch.topk takes -inf ones, which its
    implementation chooses, so such rows are tied and committed by the published call)."""
    conf, srt, rank = _prepare(conf, allowed)
    k = _as_counts(counts, conf.shape[0], conf.device)
    finite = torch.isfinite(conf)
    K = finite.sum(1)
    high = conf > threshold
    enough = high.sum(1) >= k
    top, tied = _top(conf, srt, rank, torch.minimum(k, K) if clamp else k)
    some = K > 0
    mask = torch.where(enough[:, None], high, top) & some[:, None]
    return Commit(mask, tied & ~enough & some,
                  lambda rows: H.select_llada2(conf[_index(rows, conf)], k[_index(rows, conf)].tolist(), threshold,
                                               clamp))


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=like.device)


def apply(x: torch.Tensor, x0: torch.Tensor, c: Commit, after: Callable[[], torch.Tensor] | None = None) -> list:
    """Commit: x [B, n] (a view of the canvas, updated in place) takes x0 [B, n] where c commits;
    then one readback of c.tied with after() ([k, B] integers the loop's control needs, computed
    on the updated canvas: masks left, candidates, ...). Rows a tie decides are committed by the
    published call once the readback shows them, and after() is read again. Returns after()'s
    host values, [k][B] (a list of k lists)."""
    got = P.read_with_checks(_commit(x, x0, c, after))   # the step's NaN test too
    return settle_read(x, x0, c, got, after)[0]


def _commit(x, x0, c: Commit, after) -> torch.Tensor:
    """x takes x0 where c commits (rows not tied); the [1 + k, B] tensor a readback reads."""
    x.copy_(torch.where(c.mask & ~c.tied[:, None], x0, x))
    if after is None:
        return c.tied[None].long()
    return torch.cat([c.tied[None], after()]).long()       # cat promotes the flags to after()'s integers


def apply_async(x: torch.Tensor, x0: torch.Tensor, c: Commit, after: Callable[[], torch.Tensor]) -> Readback:
    """apply() without waiting: the commit on the device and its readback on its way
    (runtime/readback.py); settle_read(x, x0, c, readback.read(), after) finishes it."""
    return Readback(_commit(x, x0, c, after))


def settle_read(x, x0, c: Commit, got: list, after) -> tuple[list, bool]:
    """After the readback `got` ([1 + k][B]: tied rows, then after()'s): the rows a tie decides
    committed by the published call (after() read again, blocking). Returns (after()'s host
    values [k][B], whether a tie changed x after the readback was taken)."""
    rows = [j for j, t in enumerate(got[0]) if t]
    if not rows:
        return got[1:], False
    idx = _index(rows, x)
    x[idx] = torch.where(c.exact(rows), x0[idx], x[idx])
    return (P.read_with_checks(after().long()) if after is not None else got[1:]), True
