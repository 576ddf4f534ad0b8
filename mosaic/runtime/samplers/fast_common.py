"""What the Fast-dLLM samplers share: the commit rules and the checks and labels of their options.

Commit rules, per row j of confidences conf [B, n] (-inf where a position is not a candidate),
as Fast-dLLM's llada/generate.py get_transfer_index / get_transfer_index_dynamic compute them
(docs/FAST_DECODING.md):

  counts     the k[j] highest (torch.topk on the full-length row, so ties break as published)
  threshold  torch.topk over every candidate; the first is always committed, every other one
             whose confidence is below the threshold is dropped (compared in conf's dtype)
  factor     the n-th most confident candidate (n = 1, 2, ...) passes when its confidence is
             >= 1 - factor / (n + 1) (the first always); the count committed is the first rank
             that fails, except that a failure at the last rank (or none) commits them all

A row with no candidate commits nothing (the published factor rule raises IndexError there)."""

from __future__ import annotations

import torch

from ...errors import InputError
from ..ties import topk


def select_threshold(conf: torch.Tensor, threshold: float, starts: list[int] | None = None) -> torch.Tensor:
    """[B, n] bool: per row, the top candidate and every candidate with conf >= threshold.
    starts: each row's first real token (ties ranked from there: runtime/ties.py)."""
    out = torch.zeros_like(conf, dtype=torch.bool)
    counts = torch.isfinite(conf).sum(1).tolist()
    for j, k in enumerate(counts):
        if k == 0:
            continue
        top, idx = topk(conf[j], k, starts[j] if starts else 0)
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
        _, idx = topk(conf[j], top, starts[j] if starts else 0)
        out[j, idx] = True
    return out


def select_counts(conf: torch.Tensor, counts, starts: list[int] | None = None) -> torch.Tensor:
    """[B, n] bool: the counts[j] most confident positions of each row (torch.topk, as published)."""
    out = torch.zeros_like(conf, dtype=torch.bool)
    for j in range(conf.shape[0]):
        _, idx = topk(conf[j], int(counts[j]), starts[j] if starts else 0)
        out[j, idx] = True
    return out


def rule(gen) -> str:
    """'threshold', 'factor' or 'counts' (the reference schedule, with a cache only)."""
    return "threshold" if gen.threshold is not None else "factor" if gen.factor is not None else "counts"


def check_fast(gen, display: str) -> None:
    """Checks every Fast-dLLM sampler makes (the config checked each value already)."""
    if not gen.accelerated:
        raise InputError(f"the {display} sampler needs cache 'prefix'/'dual', a threshold or a factor")


def fast_labels(gen, device: torch.device) -> list[str]:
    """The lossy labels of a Fast-dLLM run: what may change its tokens vs the reference sampler."""
    parts = []
    if gen.cache != "none":
        parts.append(f"cache={gen.cache} (K/V outside the block reused for the block's steps)")
    r = rule(gen)
    if r == "threshold":
        parts.append(f"threshold={gen.threshold} (every position at or above it committed per step)")
    elif r == "factor":
        parts.append(f"factor={gen.factor} (rank n committed at confidence >= 1 - factor/(n+1))")
    labels = ["fast-dllm: " + ", ".join(parts)]
    if gen.temperature > 0 and device.type == "cuda":
        labels.append("gumbel-stream: GPU random draws differ from the reference's stream")
    return labels


class FastSamplerMixin:
    """What the Fast-dLLM samplers of both families share: planned path only, no one_step
    measurement, and the lossy labels of their options (fast_labels)."""

    def native_predict(self, gen, generator, valid):
        raise InputError("the Fast-dLLM samplers run on the planned path only (native=False)")

    def one_step(self, predict, x):
        raise InputError("one_step measures the reference sampler; use `python -m bench fast` for Fast-dLLM steps")

    def lossy_labels(self, gen, device, native):
        return fast_labels(gen, device)
