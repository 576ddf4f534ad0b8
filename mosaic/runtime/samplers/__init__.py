"""One sampler object per family, chosen once from the model config."""

from __future__ import annotations

from .base import Sampler
from .dream import DreamSampler
from .llada import LLaDASampler

SAMPLERS = {"llada": LLaDASampler, "llada_moe": LLaDASampler, "dream": DreamSampler}


def sampler_for(mcfg) -> Sampler:
    """The published sampler of this model's family (LLaDA-MoE samples as LLaDA)."""
    return SAMPLERS[mcfg.family](mcfg)


__all__ = ["DreamSampler", "LLaDASampler", "SAMPLERS", "Sampler", "sampler_for"]
