"""Where a block cache's K/V live: admission of a Fast-dLLM request with its persistent store.

The store (memory/kv_store.py) holds K and V of every layer and position for the whole request;
its device part (hot layers + staging slots) is charged on top of the fill step's plan, the
largest step of the request (admission.fit). Tiers:

  device  every layer on the device (the fastest; refused when it does not fit)
  host    every layer in pinned host memory, two device staging slots (the least device memory)
  auto    the most hot layers that fit, the rest on the host (device when everything fits)

The host part is checked against the host's available memory (MemAvailable, at most 80% of it
pinned) before anything is allocated."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import MemoryBudgetError, gib
from ..loader import host_available_bytes
from ..memory.kv_store import StoreLayout
from ..models.kv_cache import CacheStep
from ..models.step import Step
from .admission import Admission, admit, fit

# step_for(length, num_masked) -> the request's first (fill) step without a cache spec
StepFor = Callable[[int, int], Step]
HOST_SHARE = 0.8   # the most of the host's available memory a store's cold layers may pin


def check_host(layout: StoreLayout, available: int | None = None) -> None:
    """MemoryBudgetError when the cold layers would not fit in the host's available memory."""
    available = host_available_bytes() if available is None else available
    if layout.host_bytes and available is not None and layout.host_bytes > HOST_SHARE * available:
        raise MemoryBudgetError(
            f"the block cache's host tier needs {gib(layout.host_bytes)} of pinned host memory "
            f"({layout.num_layers - layout.hot} layers x {gib(layout.layer_bytes)}); the host has "
            f"{gib(available)} available (at most {HOST_SHARE:.0%} of it is used)",
            needed_bytes=layout.host_bytes, budget_bytes=int(HOST_SHARE * available))


def with_store(step: Step, layout: StoreLayout) -> Step:
    """The fill step of `step`'s request charged the store's device bytes."""
    return step.with_(cache=CacheStep("fill", 0, step.length, step.length, None, layout.device_bytes))


def admit_cached(preparer, budget, step_for: StepFor, length: int, num_masked: int,
                 layout_for: Callable[[int, int | None], StoreLayout], tier: str,
                 min_length: int = 1) -> tuple[Admission, StoreLayout]:
    """Admit a cached request and choose its store layout, or raise MemoryBudgetError naming the
    longest request that fits with the smallest device share the tier allows.

    layout_for(length, hot) -> StoreLayout (hot None: every layer). tier: device | host | auto."""
    full = layout_for(length, None)
    n_layers = full.num_layers
    if tier == "host":
        hot_options = [0]
    elif tier == "device" or budget.budget_bytes is None:
        hot_options = [n_layers]
    else:
        hot_options = None

    def charged(n, masked, hot):
        return with_store(step_for(n, masked), layout_for(n, hot))

    if hot_options is not None:
        hot = hot_options[0]
        adm = admit(preparer, budget, lambda n, m: charged(n, m, hot), length, num_masked, min_length)
        check_host(layout_for(length, hot))
        return adm, layout_for(length, hot)

    def ok(hot):
        try:
            fit(preparer, budget, charged(length, num_masked, hot))
            return True
        except MemoryBudgetError:
            return False
    if ok(n_layers):
        hot = n_layers
    elif not ok(0):   # not even with every layer on the host: the refusal names what would fit
        admit(preparer, budget, lambda n, m: charged(n, m, 0), length, num_masked, min_length)
        raise AssertionError("unreachable: admit raises when the host tier does not fit")
    else:
        lo, hi = 0, n_layers - 1          # ok(lo) holds; find the most hot layers that fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid - 1
        hot = lo
    adm = admit(preparer, budget, lambda n, m: charged(n, m, hot), length, num_masked, min_length)
    check_host(layout_for(length, hot))
    return adm, layout_for(length, hot)
