"""Frozen configs, one concept per module: the model (model.py, parsed from config.json), the
engine (engine.py) with block-sparse attention (sparse.py) and per-layer precision
(precision.py), one request's options (generation.py), and the shared value checks (values.py)."""

from .engine import (
    ARENA_CHOICES,
    ATTENTION_CHOICES,
    CHUNKING_WORDS,
    DTYPE_CHOICES,
    ENGINE_ALIASES,
    FUSED_CHOICES,
    KV_TIER_CHOICES,
    LOGITS_KERNEL_CHOICES,
    LOGITS_WORDS,
    MOE_KERNEL_CHOICES,
    OFFLOAD_CHOICES,
    PARALLEL_CHOICES,
    PLANNER_CHOICES,
    TRANSIENT_POOL_CHOICES,
    VARLEN_KERNEL_CHOICES,
    EngineConfig,
)
from .generation import (
    CACHE_CHOICES,
    GENERATION_DEFAULTS,
    OPTIONS,
    SHARED_OPTIONS,
    GenerationConfig,
    Option,
    name_defaults,
)
from .model import ModelConfig
from .precision import PRECISION_DTYPES, PrecisionConfig, PrecisionRange
from .sparse import SPARSE_ESTIMATES, SPARSE_PATTERNS, SparseConfig, SparseRange, keep_count
from .values import coerce, parse_bytes

__all__ = [
    "ARENA_CHOICES", "ATTENTION_CHOICES", "CACHE_CHOICES", "CHUNKING_WORDS", "DTYPE_CHOICES", "ENGINE_ALIASES",
    "FUSED_CHOICES", "GENERATION_DEFAULTS", "KV_TIER_CHOICES", "LOGITS_KERNEL_CHOICES", "LOGITS_WORDS",
    "MOE_KERNEL_CHOICES",
    "OFFLOAD_CHOICES", "OPTIONS", "PARALLEL_CHOICES", "PLANNER_CHOICES", "PRECISION_DTYPES", "SHARED_OPTIONS",
    "SPARSE_ESTIMATES",
    "SPARSE_PATTERNS", "TRANSIENT_POOL_CHOICES", "VARLEN_KERNEL_CHOICES",
    "EngineConfig", "GenerationConfig", "ModelConfig", "Option", "PrecisionConfig",
    "PrecisionRange", "SparseConfig", "SparseRange", "coerce", "keep_count", "name_defaults",
    "parse_bytes",
]
