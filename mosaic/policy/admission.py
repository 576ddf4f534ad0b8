"""Admission's parts: a step fits the budget or not (fit), the bisection for the longest that
fits (longest), and what an admitted request carries (Admission). policy/admitter.py asks them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import MemoryBudgetError, gib
from ..memory.accounting import Budget
from ..memory.kv_store import StoreLayout
from ..models.step import Step
from ..runtime.runner import Prepared
from .prepare import Preparer

# step_for(length, num_masked) -> the request's first step at that total length (meta tensors)
StepFor = Callable[[int, int], Step]
# agree(values) -> the elementwise minimum of values over every process (runtime/parallel.py)
Agree = Callable[[list[int]], list[int]]


@dataclass(frozen=True)
class Admission:
    """An admitted request: its prepared first step, the device bytes predicted for it
    (activations + weights + context + workspace + input tensors + captured steps' graphs), the
    offload mode it runs in (a graph.streams.Offload, None: resident), a block cache's store layout
    (None: no cache) and what its captured steps are charged (policy/graph_charge.py).
    The request carries it from admission to its run: nothing about it is kept elsewhere."""
    prepared: Prepared
    predicted_bytes: int
    budget_bytes: int | None
    offload: object = None
    layout: StoreLayout | None = None
    graphs: object = None        # a policy.graph_charge.GraphCharge (None: steps never captured)

    @property
    def captured(self) -> bool:
        """Whether the request's steps may be captured (runtime/graphs.py)."""
        return self.graphs is not None and self.graphs.captured

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


def alone(values: list[int]) -> list[int]:
    """The `agree` of a single process: its own values."""
    return values
