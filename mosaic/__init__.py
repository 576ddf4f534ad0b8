"""Mosaic: a memory-first inference engine for diffusion LLMs."""

__version__ = "0.1.0"

from . import compat  # noqa: E402  (the official calling conventions: mosaic.compat.generate, ...)
from .config import EngineConfig, GenerationConfig, ModelConfig  # noqa: E402
from .engine import Generation, LengthWarning, MosaicEngine, SpeculationWarning  # noqa: E402
from .engine.calibrate import calibrate  # noqa: E402
from .errors import CheckpointError, InputError, MemoryBudgetError, MosaicError  # noqa: E402
from .loader import load  # noqa: E402

__all__ = ["CheckpointError", "EngineConfig", "Generation", "GenerationConfig", "InputError", "LengthWarning",
           "MemoryBudgetError", "ModelConfig", "MosaicEngine", "MosaicError", "SpeculationWarning", "calibrate",
           "compat", "load"]
