"""The longest request an engine admits: prompt + canvas tokens under its budget and max_seq_len,
found with the engine's own admission (MosaicEngine.admit), the code path every request takes."""

from __future__ import annotations

import dataclasses

from ..config import GenerationConfig
from ..engine import MosaicEngine
from ..errors import MemoryBudgetError

PROBE_TOKENS = 1 << 21   # how far to look when max_seq_len does not bound the search


def capacity_tokens(engine: MosaicEngine, gen: GenerationConfig | None = None) -> int | None:
    """Longest prompt + max_new_tokens that admission accepts, or None when nothing limits it
    (no budget, no max_seq_len). The figure is exact: a request of that many tokens of the shape
    below is admitted by engine.admit and one of a token more is refused.

    gen None (the server, /health capacity_tokens and /v1/models max_model_len): requests with
    the model's default sampler options, batch 1, and the worst split of the length, a 1-token
    prompt and max_tokens = capacity - 1 (every canvas position masked at the first step: the
    largest first step of that length). A longer prompt with the same total masks fewer rows,
    so it is admitted too (it may even fit a few tokens more; each request is admitted on its own).

    gen given (mosaic chat): its canvas of gen.max_new_tokens fixed, the prompt (the history)
    growing; the capacity is then at least gen.max_new_tokens (nothing fits: the figure is
    gen.max_new_tokens, so every turn is refused)."""
    limit = engine.config.max_length
    if engine.budget.budget_bytes is None or engine.config.native:
        return limit
    fixed = gen is not None
    gen = gen or engine.generation_config()

    def shape(n: int) -> GenerationConfig:
        if fixed:
            return gen
        canvas = max(1, n - 1)
        block = None if gen.block_length is None else min(gen.block_length, canvas)
        return dataclasses.replace(gen, max_new_tokens=canvas, block_length=block)

    def refusal(n: int) -> MemoryBudgetError | None:
        try:
            engine.admit(1, n, shape(n))
            return None
        except MemoryBudgetError as e:
            return e

    least = gen.max_new_tokens + 1 if fixed else 2   # the shortest request of the shape
    hi = limit or PROBE_TOKENS
    err = refusal(hi)
    if err is None:
        return hi
    # the refusal names the longest that fits by its own search (masked rows scaled with the
    # length): a close guess, checked here with the exact shape
    lo = max(least - 1, min(err.max_tokens or 0, hi - 1))
    while lo >= least and (err := refusal(lo)) is not None:
        hi = lo
        lo = max(least - 1, min(err.max_tokens or 0, lo - 1))
    if lo < least:
        return least - 1
    step = 1   # lo fits, hi does not: gallop up from lo, then bisect
    while lo + step < hi and refusal(lo + step) is None:
        lo, step = lo + step, step * 2
    hi = min(hi, lo + step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if refusal(mid) is None:
            lo = mid
        else:
            hi = mid
    return lo
