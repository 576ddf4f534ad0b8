"""The longest request the server's engine admits (MosaicEngine.capacity: the one L_max search,
policy/admitter.py), under the names the server and `mosaic chat` use, and the ceiling above which
no request can be admitted at all (the quick refusal of a prompt whose size alone is too long)."""

from __future__ import annotations

from ..config import GenerationConfig
from ..engine import MosaicEngine
from ..errors import MemoryBudgetError
from ..policy.admitter import GRID

PROBE_TOKENS = 1 << 40   # a length no budget holds: its refusal names the longest that fits


def capacity_tokens(engine: MosaicEngine, gen: GenerationConfig | None = None) -> int | None:
    """Longest prompt + max_new_tokens that admission accepts, to the token, or None when nothing
    limits it: gen None: the model's default options with the worst split of the length (a
    1-token prompt); gen given (mosaic chat): its canvas fixed, the prompt growing."""
    return engine.capacity(gen)


def admit_ceiling(engine: MosaicEngine) -> tuple[int | None, int | None]:
    """(bound, longest): bound, an upper bound on prompt + max_tokens of any request the engine
    admits, None when nothing limits the length; longest, the figure to report. max_length is a
    hard limit (both); under a memory budget, longest is the longest request of the cheapest
    shape, a canvas of 1 token with one step (a longer canvas at the same length masks more
    rows), and bound adds one search step (GRID tokens: the admitter may search on that grid).
    One admission probe (its MemoryBudgetError names the longest that fits)."""
    limit = engine.config.max_length
    if not engine.memory.has_budget or engine.config.native:
        return limit, limit
    try:
        engine.admit(1, PROBE_TOKENS, GenerationConfig(max_new_tokens=1, steps=1))
    except MemoryBudgetError as e:
        if e.max_tokens is not None:
            if limit is not None and limit <= e.max_tokens:
                return limit, limit
            return e.max_tokens + GRID if limit is None else min(limit, e.max_tokens + GRID), e.max_tokens
    return limit, limit
