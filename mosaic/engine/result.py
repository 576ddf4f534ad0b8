"""What generate() returns (Generation) and how a run's statistics are reported."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..config import GenerationConfig


@dataclass
class Generation:
    """The result of generate(): texts, tokens [B, max_new_tokens] and sequences [B, prompt +
    max_new_tokens] (on the CPU), the path taken, steps (the sampler's steps: its schedule's count,
    or for Fast-dLLM, whose count depends on the data, the forwards it took), seconds, the device
    peak (bytes), the labels of options that may change tokens relative to the reference sampler,
    the run's statistics (Fast-dLLM: nfe, cache; docs/FAST_DECODING.md), the offload mode that
    ran, each layer's weight precision, the bytes admission predicted (None: native path), whether
    it stopped early (on_step returned True: the rest of the canvas could not change the answer),
    steps_run, the denoising steps that ran (< steps when it stopped early), and whether it ran
    positions beyond the length the model was trained for (config.json's; it ran, with a
    LengthWarning the first time, but the answer may degrade).

    A list of prompts runs as a batch of requests (engine/scheduler.py): `parts` holds each
    request's own Generation, in order, and the fields above combine them (combine())."""
    texts: list[str]
    tokens: torch.Tensor
    sequences: torch.Tensor
    path: str                     # "native" or "planned"
    steps: int
    seconds: float
    peak_device_bytes: int
    config: GenerationConfig
    lossy: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    offload: str = "resident"     # resident | weights | weights+kv (policy/offload.py)
    precision: list[str] = field(default_factory=list)   # per layer weight dtype
    predicted_bytes: int | None = None
    stopped_early: bool = False
    steps_run: int = 0
    parts: list = field(default_factory=list)      # each request's Generation (a list of prompts)
    beyond_trained_length: bool = False

    @property
    def text(self) -> str:
        return self.texts[0]


def fast_stats(gen: GenerationConfig, loop_stats: dict, store, nfe: int) -> dict:
    """Fast-dLLM statistics of a run: nfe, the forwards of this (batched) run; nfe_per_row, the
    forwards each row would take alone; the block cache's tier and bytes."""
    stats = {"nfe": nfe, "cache": gen.cache, "threshold": gen.threshold, "factor": gen.factor,
             "nfe_per_token": nfe / gen.max_new_tokens, "nfe_per_row": loop_stats.get("row_nfe")}
    if "forwards_discarded" in loop_stats:    # block steps launched ahead and not used (not in nfe)
        stats["forwards_discarded"] = loop_stats["forwards_discarded"]
    if store is not None:
        lay = store.layout
        stats |= {"kv_tier": lay.tier, "hot_layers": lay.hot, "kv_device_bytes": lay.device_bytes,
                  "kv_host_bytes": lay.host_bytes, "kv_transfer_bytes": store.transfer_bytes}
    return stats


# how combine() merges the statistics of a batch's requests (any other float: the mean; a list:
# concatenated; a dict: its numbers summed per key; anything else: the first request's)
_MAX_STATS = {"nfe"}              # the rounds the batch ran: its longest request's forwards
_SUM_STATS = {"tokens", "forwards_discarded", "kv_device_bytes", "kv_host_bytes", "kv_transfer_bytes"}


def combine(parts: list[Generation], seconds: float, pad: int) -> Generation:
    """One Generation of a batch of requests: texts and tokens [B, G] in order (every request has
    the same canvas G), sequences left-padded with `pad` to the longest; steps / steps_run: the
    most any request took; seconds: the batch's wall time; lossy labels in first-seen order;
    stats merged (Fast-dLLM: nfe the batch's rounds, nfe_per_row each request's forwards)."""
    if len(parts) == 1:
        return dataclasses.replace(parts[0], seconds=seconds)
    width = max(p.sequences.shape[1] for p in parts)
    seqs = torch.cat([torch.nn.functional.pad(p.sequences, (width - p.sequences.shape[1], 0), value=pad)
                      for p in parts])
    first = parts[0]
    lossy = list(dict.fromkeys(label for p in parts for label in p.lossy))
    preds = [p.predicted_bytes for p in parts if p.predicted_bytes is not None]
    stats = merge_stats([p.stats for p in parts])
    if "nfe_per_token" in stats:      # the batch's rounds per canvas token, as one request reports it
        stats["nfe_per_token"] = stats["nfe"] / first.config.max_new_tokens
    return Generation([t for p in parts for t in p.texts], torch.cat([p.tokens for p in parts]), seqs, first.path,
                      max(p.steps for p in parts), seconds, max(p.peak_device_bytes for p in parts), first.config,
                      lossy, stats, first.offload, first.precision,
                      max(preds) if preds else None, all(p.stopped_early for p in parts),
                      max(p.steps_run for p in parts), list(parts),
                      any(p.beyond_trained_length for p in parts))


def merge_stats(stats: list[dict]) -> dict:
    """The statistics of several requests as one (see _MAX_STATS / _SUM_STATS)."""
    out = {}
    for key in dict.fromkeys(k for s in stats for k in s):
        vals = [s[key] for s in stats if key in s]
        if key in _MAX_STATS:
            out[key] = max(vals)
        elif key in _SUM_STATS:
            out[key] = sum(vals)
        elif all(isinstance(v, list) for v in vals):
            out[key] = [x for v in vals for x in v]
        elif all(isinstance(v, dict) for v in vals):      # counts summed (accepted, graphs), the rest the first's
            out[key] = {k: _sum_or_first([v[k] for v in vals if k in v]) for k in dict.fromkeys(k for v in vals
                                                                                                for k in v)}
        elif all(isinstance(v, float) for v in vals):
            out[key] = sum(vals) / len(vals)
        else:
            out[key] = vals[0]
    return out


def _sum_or_first(vals: list):
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals)
    return sum(vals) if numbers else vals[0]


def graph_stats(graphs, before: dict | None, admission) -> dict | None:
    """A request's captured steps (runtime/graphs.py): mode "captured" (its steps may be
    captured; eligible ones replay) or "eager" (admission left them eager, `note` says why: no
    room in the budget for its graphs, offload, cfg, ...), and the captures, replays, eager
    steps, eager reruns of draws and failed captures during it. None on the native path or
    where steps are never captured."""
    if graphs is None or before is None or admission is None:
        return None
    now = graphs.stats.snapshot()
    out = {"mode": "captured" if admission.captured else "eager"} | {k: now[k] - before[k] for k in now}
    charge = admission.graphs
    if charge is not None and charge.note:
        out["note"] = charge.note
    if charge is not None and charge.captured and charge.total_bytes:
        out["charged_bytes"] = charge.total_bytes
    return out
