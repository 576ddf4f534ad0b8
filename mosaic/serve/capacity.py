"""The longest request an engine admits: prompt + canvas tokens under its budget and max_seq_len."""

from __future__ import annotations

import dataclasses

from ..config import GenerationConfig
from ..engine import MosaicEngine
from ..errors import MemoryBudgetError

PROBE_TOKENS = 1 << 21   # how far to look when max_seq_len does not bound the search


def capacity_tokens(engine: MosaicEngine, gen: GenerationConfig | None = None) -> int | None:
    """Longest prompt + max_new_tokens that admission accepts for requests like `gen` (default:
    the model's generation defaults), or None when nothing limits it (no budget, no max_seq_len).

    One admission probe: the budget's refusal names the longest that fits (a binary search over
    the prepared first step, policy/admission.py), so this costs one refusal, not a sweep. The
    masked rows scale with the length in that search, so a request much shorter than the probe
    may need a little more than this figure: each request is admitted on its own anyway."""
    limit = engine.config.max_length
    if engine.budget.budget_bytes is None or engine.config.native:
        return limit
    gen = gen or engine.generation_config()
    length = limit or PROBE_TOKENS
    probe = dataclasses.replace(gen, max_new_tokens=min(gen.max_new_tokens, length // 2),
                                block_length=None if gen.block_length is None
                                else min(gen.block_length, length // 2))
    try:
        engine.admit(1, length, probe)
        return length
    except MemoryBudgetError as e:
        return e.max_tokens
