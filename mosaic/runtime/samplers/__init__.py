"""The samplers, registered by name; a family's record (models/families/) names the ones it
samples with (Family.samplers), and sampler_for builds the one a request needs.

A new family that samples as an existing one touches nothing here; a new loop is a Sampler
subclass in this package and one line in REGISTRY."""

from __future__ import annotations

from ...models.families import family_of
from .base import Sampler
from .block_diffusion import BlockDiffusionSampler
from .dream import DreamSampler
from .fast_dream import FastDreamSampler
from .fast_llada import FastLLaDASampler
from .llada import LLaDASampler
from .speculative_families import SpeculativeDreamSampler, SpeculativeLLaDASampler

# name (Family.samplers) -> class; every sampler is built as cls(model_config)
REGISTRY: dict[str, type[Sampler]] = {
    "llada": LLaDASampler,                       # GSAI-ML/LLaDA generate.py (LLaDA, iLLaDA, LLaDA-MoE)
    "fast_llada": FastLLaDASampler,              # Fast-dLLM's caches and parallel commits (opt-in, lossy)
    "speculative_llada": SpeculativeLLaDASampler,   # self-speculative, exact (opt-in)
    "dream": DreamSampler,                       # Dream's diffusion_generate
    "fast_dream": FastDreamSampler,
    "speculative_dream": SpeculativeDreamSampler,
    "block_diffusion": BlockDiffusionSampler,    # LLaDA2.x generate() (and samplers of its kind)
}


def sampler_for(mcfg, gen=None) -> Sampler:
    """The published sampler of this model's family (its record names it), its self-speculative
    variant when the request `gen` sets speculate > 0 (it refuses Fast-dLLM's options itself),
    or its Fast-dLLM variant when `gen` asks for a cache, a threshold or a factor. A family
    without such a variant (LLaDA2.x) gets its own sampler, which refuses the option."""
    names = family_of(mcfg).samplers
    if gen is not None and gen.speculate and names.speculative:
        return REGISTRY[names.speculative](mcfg)
    if gen is not None and gen.accelerated and names.fast:
        return REGISTRY[names.fast](mcfg)
    return REGISTRY[names.exact](mcfg)


__all__ = ["REGISTRY", "BlockDiffusionSampler", "DreamSampler", "FastDreamSampler", "FastLLaDASampler",
           "LLaDASampler", "Sampler", "SpeculativeDreamSampler", "SpeculativeLLaDASampler", "sampler_for"]
