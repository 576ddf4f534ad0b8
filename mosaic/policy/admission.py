"""Admission: a request is admitted only if its first (largest) step fits the budget, decided
before anything is allocated for it; a refusal names the longest request that would fit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import MemoryBudgetError, gib
from ..memory.accounting import Budget
from ..models.step import Step
from ..runtime.runner import Prepared
from .prepare import Preparer

# step_for(length, num_masked) -> the request's first step at that total length (meta tensors)
StepFor = Callable[[int, int], Step]


@dataclass(frozen=True)
class Admission:
    """An admitted request: its prepared first step and the device bytes predicted for it
    (activations + weights + context + workspace + input tensors)."""
    prepared: Prepared
    predicted_bytes: int
    budget_bytes: int | None

    @property
    def chunks(self) -> tuple[int, int, int]:
        return self.prepared.chunks.as_tuple()


def fit(preparer: Preparer, budget: Budget, step: Step, variants=()) -> Prepared:
    """The prepared step if it fits the budget; MemoryBudgetError (activation bytes) if not.

    variants: functions step -> step for the other kinds of step the request will run (e.g. its
    block-sparse steps after the dense ones): each must fit too; the largest need is returned."""
    best = None
    limit = budget.activation_limit(step.batch, step.length)
    for variant in (lambda s: s, *variants):
        prepared = preparer.prepare(variant(step), remember=False)
        if limit is not None and prepared.need_bytes > limit:  # fixed chunk counts are not searched
            raise MemoryBudgetError(f"chunks {prepared.chunks.as_tuple()} need {gib(prepared.need_bytes)}; "
                                    f"{gib(limit)} is left for activations",
                                    needed_bytes=prepared.need_bytes, budget_bytes=limit)
        if best is None or prepared.need_bytes > best.need_bytes:
            best = prepared
    return best


def longest(ok: Callable[[int], bool], lo: int, hi: int, unit: int = 1024) -> int:
    """Largest multiple of `unit` in [lo, hi] with ok(n) true (ok is monotone); 0 if none."""
    lo_u, hi_u = max(1, -(-lo // unit)), max(1, hi // unit)
    if lo_u > hi_u or not ok(lo_u * unit):
        return 0
    while lo_u < hi_u:
        mid = (lo_u + hi_u + 1) // 2
        if ok(mid * unit):
            lo_u = mid
        else:
            hi_u = mid - 1
    return lo_u * unit


def longest_fitting(preparer: Preparer, budget: Budget, step_for: StepFor, length: int, num_masked: int,
                    min_length: int = 1, variants=()) -> int:
    """The longest total length (same masked share as this request) whose first step fits."""
    def ok(n):
        try:
            fit(preparer, budget, step_for(n, max(1, round(num_masked * n / length))), variants)
            return True
        except MemoryBudgetError:
            return False
    return longest(ok, min_length, length, unit=1)


def admit(preparer: Preparer, budget: Budget, step_for: StepFor, length: int, num_masked: int,
          min_length: int = 1, variants=()) -> Admission:
    """Admit a request of `length` total tokens whose first step has `num_masked` masked slots,
    or raise MemoryBudgetError saying what it needs, what the budget is and the longest request
    (in tokens, min_length at least) that would fit."""
    step = step_for(length, num_masked)
    try:
        prepared = fit(preparer, budget, step, variants)
    except MemoryBudgetError as e:
        best = longest_fitting(preparer, budget, step_for, length, num_masked, min_length, variants)
        need = budget.total(e.needed_bytes, step.batch, step.length)
        batch = step.batch // (2 if step.rows_uncond is not None else 1)  # cfg runs the batch twice
        raise MemoryBudgetError(
            f"request of {batch} x {length:,} tokens needs at least {gib(need)}; budget is "
            f"{gib(budget.budget_bytes)} (weights {gib(budget.weights_bytes)}, context and workspace "
            f"{gib(budget.fixed_bytes - budget.weights_bytes)}); longest that fits: {best:,} tokens",
            needed_bytes=need, budget_bytes=budget.budget_bytes, max_tokens=best) from None
    return Admission(prepared, budget.total(prepared.need_bytes, step.batch, step.length), budget.budget_bytes)
