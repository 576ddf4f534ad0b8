"""What generate() returns (Generation) and how a run's statistics are reported."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import GenerationConfig


@dataclass
class Generation:
    """The result of generate(): texts, tokens [B, max_new_tokens] and sequences [B, prompt +
    max_new_tokens] (on the CPU), the path taken, steps, seconds, the device peak (bytes), the
    labels of options that may change tokens relative to the reference sampler, the run's
    statistics (Fast-dLLM: nfe, cache; docs/FAST_DECODING.md), the offload mode that ran, each
    layer's weight precision, the bytes admission predicted (None: native path) and whether it
    stopped early (`stop` returned True: the rest of the canvas could not change the answer)."""
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

    @property
    def text(self) -> str:
        return self.texts[0]


def fast_stats(gen: GenerationConfig, loop_stats: dict, store, nfe: int) -> dict:
    """Fast-dLLM statistics of a run: nfe, the forwards of this (batched) run; nfe_per_row, the
    forwards each row would take alone; the block cache's tier and bytes."""
    stats = {"nfe": nfe, "cache": gen.cache, "threshold": gen.threshold, "factor": gen.factor,
             "nfe_per_token": nfe / gen.max_new_tokens, "nfe_per_row": loop_stats.get("row_nfe")}
    if store is not None:
        lay = store.layout
        stats |= {"kv_tier": lay.tier, "hot_layers": lay.hot, "kv_device_bytes": lay.device_bytes,
                  "kv_host_bytes": lay.host_bytes, "kv_transfer_bytes": store.transfer_bytes}
    return stats


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
