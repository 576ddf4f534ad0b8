"""One sampler object per family, chosen once from the model config."""

from __future__ import annotations

from .base import Sampler
from .block_diffusion import BlockDiffusionSampler
from .dream import DreamSampler
from .fast_dream import FastDreamSampler
from .fast_llada import FastLLaDASampler
from .llada import LLaDASampler

# iLLaDA samples with LLaDA's generate.py (mask id 5: ML-GSAI/LLaDA README)
SAMPLERS = {"llada": LLaDASampler, "llada_moe": LLaDASampler, "illada": LLaDASampler, "dream": DreamSampler,
            "llada2": BlockDiffusionSampler}
# Fast-dLLM's accelerated samplers (opt-in: GenerationConfig cache / threshold / factor)
FAST_SAMPLERS = {"llada": FastLLaDASampler, "llada_moe": FastLLaDASampler, "illada": FastLLaDASampler,
                 "dream": FastDreamSampler,
                 # LLaDA2's own sampler already reads the threshold (its published default is 0.95)
                 "llada2": BlockDiffusionSampler}


def sampler_for(mcfg, gen=None) -> Sampler:
    """The published sampler of this model's family (LLaDA-MoE samples as LLaDA), or its
    Fast-dLLM variant when the request `gen` asks for a cache, a threshold or a factor."""
    if gen is not None and gen.accelerated:
        return FAST_SAMPLERS[mcfg.family](mcfg)
    return SAMPLERS[mcfg.family](mcfg)


__all__ = ["BlockDiffusionSampler",
           "DreamSampler", "FAST_SAMPLERS", "FastDreamSampler", "FastLLaDASampler", "LLaDASampler", "SAMPLERS",
           "Sampler", "sampler_for"]
