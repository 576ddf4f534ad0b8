"""One sampler object per family, chosen once from the model config."""

from __future__ import annotations

from .base import Sampler
from .block_diffusion import BlockDiffusionSampler
from .dream import DreamSampler
from .fast_dream import FastDreamSampler
from .fast_llada import FastLLaDASampler
from .llada import LLaDASampler
from .speculative_families import SpeculativeDreamSampler, SpeculativeLLaDASampler

# iLLaDA samples with LLaDA's generate.py (mask id 5: ML-GSAI/LLaDA README)
SAMPLERS = {"llada": LLaDASampler, "llada_moe": LLaDASampler, "illada": LLaDASampler, "dream": DreamSampler,
            "llada2": BlockDiffusionSampler}
# Fast-dLLM's accelerated samplers (opt-in: GenerationConfig cache / threshold / factor)
FAST_SAMPLERS = {"llada": FastLLaDASampler, "llada_moe": FastLLaDASampler, "illada": FastLLaDASampler,
                 "dream": FastDreamSampler,
                 # LLaDA2's own sampler already reads the threshold (its published default is 0.95)
                 "llada2": BlockDiffusionSampler}
# self-speculative verification of the exact samplers (opt-in, exact: GenerationConfig.speculate)
SPECULATIVE_SAMPLERS = {"llada": SpeculativeLLaDASampler, "llada_moe": SpeculativeLLaDASampler,
                        "illada": SpeculativeLLaDASampler, "dream": SpeculativeDreamSampler}


def sampler_for(mcfg, gen=None) -> Sampler:
    """The published sampler of this model's family (LLaDA-MoE samples as LLaDA), its
    self-speculative variant when the request `gen` sets speculate > 0 (it refuses Fast-dLLM's
    options itself), or its Fast-dLLM variant when `gen` asks for a cache, a threshold or a
    factor. A family without a speculative variant (LLaDA2.x) gets its own sampler, which
    refuses the option."""
    if gen is not None and gen.speculate and mcfg.family in SPECULATIVE_SAMPLERS:
        return SPECULATIVE_SAMPLERS[mcfg.family](mcfg)
    if gen is not None and gen.accelerated:
        return FAST_SAMPLERS[mcfg.family](mcfg)
    return SAMPLERS[mcfg.family](mcfg)


__all__ = ["BlockDiffusionSampler",
           "DreamSampler", "FAST_SAMPLERS", "FastDreamSampler", "FastLLaDASampler", "LLaDASampler", "SAMPLERS",
           "SPECULATIVE_SAMPLERS", "Sampler", "SpeculativeDreamSampler", "SpeculativeLLaDASampler", "sampler_for"]
