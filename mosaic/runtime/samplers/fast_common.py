"""What the Fast-dLLM samplers share: the checks and labels of their options. The commit rules
are runtime/commit.py (on the device, every row at once) with their published host versions,
the oracle, in runtime/commit_host.py (re-exported here)."""

from __future__ import annotations

import torch

from ...errors import InputError
from ..commit_host import select_counts, select_factor, select_threshold

__all__ = ["select_counts", "select_factor", "select_threshold", "rule", "check_fast", "fast_labels",
           "FastSamplerMixin"]


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
