"""Mosaic: a memory-first inference engine for diffusion LLMs."""

from .config import EngineConfig, GenerationConfig, ModelConfig
from .engine import Generation, MosaicEngine
from .errors import CheckpointError, InputError, MemoryBudgetError, MosaicError
from .loader import load

__version__ = "0.1.0"

__all__ = ["CheckpointError", "EngineConfig", "Generation", "GenerationConfig", "InputError",
           "MemoryBudgetError", "ModelConfig", "MosaicEngine", "MosaicError", "load"]
