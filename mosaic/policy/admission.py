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
# agree(values) -> the elementwise minimum of values over every process (runtime/parallel.py)
Agree = Callable[[list[int]], list[int]]


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


def resident_bytes(step: Step) -> int:
    """Device bytes a step needs besides its plan that live across steps: a block cache's K/V
    (models/kv_cache.CacheStep.resident_bytes; 0 for every other step)."""
    return int(getattr(step.cache, "resident_bytes", 0) or 0)


def fit(preparer: Preparer, budget: Budget, step: Step, variants=()) -> Prepared:
    """The prepared step if it fits the budget; MemoryBudgetError (activation bytes) if not.

    A block cache's persistent K/V (resident_bytes) are charged on top of the step's plan.
    variants: functions step -> step for the other kinds of step the request will run (e.g. its
    block-sparse steps after the dense ones): each must fit too; the largest need is returned."""
    best = None
    limit = budget.activation_limit(step.batch, step.length, step.shard_slots)
    for variant in (lambda s: s, *variants):
        st = variant(step)
        prepared = preparer.prepare(st, remember=False)
        need = prepared.need_bytes + resident_bytes(st)
        if limit is not None and need > limit:  # fixed chunk counts are not searched
            what = f" + a block cache of {gib(resident_bytes(st))}" if resident_bytes(st) else ""
            raise MemoryBudgetError(f"chunks {prepared.chunks.as_tuple()} need {gib(prepared.need_bytes)}{what}; "
                                    f"{gib(limit)} is left for activations", needed_bytes=need, budget_bytes=limit)
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
    if length < 1:
        return 0

    def ok(n):
        try:
            fit(preparer, budget, step_for(n, max(1, round(num_masked * n / length))), variants)
            return True
        except MemoryBudgetError:
            return False
    return longest(ok, min_length, length, unit=1)


def alone(values: list[int]) -> list[int]:
    """The `agree` of a single process: its own values."""
    return values


def admit(preparer: Preparer, budget: Budget, step_for: StepFor, length: int, num_masked: int,
          min_length: int = 1, variants=(), agree: Agree = None, world: int = 1) -> Admission:
    """Admit a request of `length` total tokens whose first step has `num_masked` masked slots,
    or raise MemoryBudgetError saying what it needs, what the budget is and the longest request
    (in tokens, min_length at least) that would fit.

    Several processes (sequence parallelism, `world` of them): every rank runs this with its own
    step_for (its own shard) and agree, the elementwise minimum over all ranks of a list of
    ints; the request is admitted only if every rank's step fits, the need reported is the
    largest of any rank and the longest that fits is the shortest of the ranks' longest, so that
    every rank reaches the same decision and raises the same error."""
    step = step_for(length, num_masked)
    prepared, need = None, 0
    try:
        prepared = fit(preparer, budget, step, variants)
        need = prepared.need_bytes + resident_bytes(step)
    except MemoryBudgetError as e:
        need = e.needed_bytes
    ok, neg_need = (agree or alone)([int(prepared is not None), -need])
    if ok:
        return Admission(prepared, budget.total(prepared.need_bytes + resident_bytes(step), step.batch, step.length,
                                                step.shard_slots), budget.budget_bytes)
    best = longest_fitting(preparer, budget, step_for, length, num_masked, min_length, variants)
    best = (agree or alone)([best])[0]
    need = budget.total(-neg_need, step.batch, step.length, step.shard_slots)
    batch = step.batch // (2 if step.rows_uncond is not None else 1)  # cfg runs the batch twice
    kv = f" (of which a block cache's K/V {gib(resident_bytes(step))})" if resident_bytes(step) else ""
    per, on = (" per GPU", f" on {world} GPUs") if world > 1 else ("", "")
    # two sizes that round alike ("needs 0.33 GiB; budget is 0.33 GiB") are shown to the byte
    size = gib if gib(need) != gib(budget.budget_bytes) else (lambda b: f"{b:,} bytes")
    raise MemoryBudgetError(
        f"request of {batch} x {length:,} tokens needs at least {size(need)}{per}{kv}; budget is "
        f"{size(budget.budget_bytes)}{per} (weights {gib(budget.weights_bytes)}, context and workspace "
        f"{gib(budget.fixed_bytes - budget.weights_bytes)}); longest that fits{on}: {best:,} tokens",
        needed_bytes=need, budget_bytes=budget.budget_bytes, max_tokens=best)
