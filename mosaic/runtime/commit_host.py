"""The published commit rules as the published code runs them: one torch.topk per row, on the
host's loop. They are the oracle of the device-side rules (runtime/commit.py) and the fallback
those rules call for a row where a tie among equal confidences decides what is committed
(torch.topk's choice among equal values belongs to its implementation: libstdc++'s introselect
or partial sort on the CPU, a radix select and a bitonic or radix sort on CUDA).

Per row j of confidences conf [B, n] (-inf where a position is not a candidate), as Fast-dLLM's
llada/generate.py get_transfer_index / get_transfer_index_dynamic (NVlabs/Fast-dLLM f6b35ec) and
LLaDA2's generate() (inclusionAI/dFactory 49c315c) compute them (docs/FAST_DECODING.md,
docs/MODELS.md):

  counts     the k[j] highest (torch.topk on the full-length row, so ties break as published)
  threshold  torch.topk over every candidate; the first is always committed, every other one
             whose confidence is below the threshold is dropped (compared in conf's dtype)
  factor     the n-th most confident candidate (n = 1, 2, ...) passes when its confidence is
             >= 1 - factor / (n + 1) (the first always); the count committed is the first rank
             that fails, except that a failure at the last rank (or none) commits them all
  top+thr    Dream's uncached confidence_threshold loop (dream/model/generation_utils.py): the
             k[j] highest by torch.topk, of which the first always and the others at or above
             the threshold
  llada2     every candidate with confidence > threshold when there are at least k of them,
             else the min(k, candidates) most confident

A row with no candidate commits nothing (the published factor rule raises IndexError there).
starts: per row the index of its first real token, ties ranked from there (runtime/ties.py)."""

from __future__ import annotations

import torch

from .ties import topk


def _start(starts: list[int] | None, j: int) -> int:
    return starts[j] if starts else 0


def select_threshold(conf: torch.Tensor, threshold: float, starts: list[int] | None = None) -> torch.Tensor:
    """[B, n] bool: per row, the top candidate and every candidate with conf >= threshold."""
    out = torch.zeros_like(conf, dtype=torch.bool)
    counts = torch.isfinite(conf).sum(1).tolist()
    for j, k in enumerate(counts):
        if k == 0:
            continue
        top, idx = topk(conf[j], k, _start(starts, j))
        keep = ~(top < threshold)          # the published test drops "< threshold" (in conf's dtype)
        keep[0] = True
        out[j, idx[keep]] = True
    return out


def select_factor(conf: torch.Tensor, factor: float, starts: list[int] | None = None) -> torch.Tensor:
    """[B, n] bool: Fast-dLLM's factor rule per row (see the module docstring)."""
    out = torch.zeros_like(conf, dtype=torch.bool)
    for j in range(conf.shape[0]):
        cand = torch.isfinite(conf[j])
        k = int(cand.sum())
        if k == 0:
            continue
        ranked = torch.sort(conf[j][cand], descending=True)[0]
        threshs = [-1.0] + [1 - factor / (n + 1) for n in range(2, k + 1)]
        top = k - 1
        for r in range(k):
            if ranked[r] < threshs[r]:
                top = r
                break
        if top == 0 or top == k - 1:
            top += 1
        _, idx = topk(conf[j], top, _start(starts, j))
        out[j, idx] = True
    return out


def select_counts(conf: torch.Tensor, counts, starts: list[int] | None = None) -> torch.Tensor:
    """[B, n] bool: the counts[j] most confident positions of each row (torch.topk, as published)."""
    out = torch.zeros_like(conf, dtype=torch.bool)
    for j in range(conf.shape[0]):
        _, idx = topk(conf[j], int(counts[j]), _start(starts, j))
        out[j, idx] = True
    return out


def select_top_threshold(conf: torch.Tensor, counts, threshold: float, starts: list[int] | None = None) -> torch.Tensor:
    """[B, n] bool: per row with counts[j] > 0, the first of its top counts[j] and every other one
    of them with conf >= threshold (Dream's uncached threshold loop)."""
    out = torch.zeros_like(conf, dtype=torch.bool)
    for j in range(conf.shape[0]):
        k = int(counts[j])
        if k == 0:
            continue
        top, idx = topk(conf[j], k, _start(starts, j))
        keep = ~(top < threshold)
        keep[0] = True
        out[j, idx[keep]] = True
    return out


def select_llada2(conf: torch.Tensor, counts, threshold: float, clamp: bool = True) -> torch.Tensor:
    """[B, n] bool: LLaDA2's rule per row with a candidate (the module docstring)."""
    out = torch.zeros_like(conf, dtype=torch.bool)
    for j in range(conf.shape[0]):
        active = torch.isfinite(conf[j])
        if bool(active.any()):
            out[j] = commit_llada2_row(conf[j], active, int(counts[j]), threshold, clamp)
    return out


def commit_llada2_row(conf: torch.Tensor, active: torch.Tensor, k: int, threshold: float,
                      clamp: bool = True) -> torch.Tensor:
    """[block] bool: the published rule over one sequence's block (conf -inf where not masked);
    clamp: the top-k takes at most the candidates (LLaDA2), else k positions (SDAR's
    torch.topk(confidence, k), which then takes positions that are not candidates)."""
    high = conf > threshold
    if int(high.sum()) >= k:
        return high
    out = torch.zeros_like(active)
    out[torch.topk(conf, k=min(k, int(active.sum())) if clamp else k)[1]] = True
    return out
