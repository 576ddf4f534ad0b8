"""Where a block cache's K/V live: the store charged to a Fast-dLLM request's fill step
(policy/admitter.py chooses the hot layers).

The store (memory/kv_store.py) holds K and V of every layer and position for the whole request;
its device part (hot layers + staging slots) is charged on top of the fill step's plan, the
largest step of the request (admission.fit). Tiers:

  device  every layer on the device (the fastest; refused when it does not fit)
  host    every layer in pinned host memory, two device staging slots (the least device memory)
  auto    the most hot layers that fit, the rest on the host (device when everything fits)

The host part is checked against the host's available memory (MemAvailable, or a cgroup
limit's room: host_memory.py; at most 80% of it pinned) before anything is allocated."""

from __future__ import annotations

from ..errors import MemoryBudgetError, gib
from ..loader import host_available_bytes
from ..memory.kv_store import StoreLayout
from ..models.kv_cache import CacheStep
from ..models.step import Step

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


def with_store(step: Step, layout: StoreLayout, extra_bytes: int = 0, cached: bool = True) -> Step:
    """The fill step of `step`'s request charged the store's device bytes (cached; else none)
    and extra_bytes held besides (the K/V pool's growth or idle buffers: admitter.py need)."""
    store = layout.device_bytes if cached else 0
    return step.with_(cache=CacheStep("fill", 0, step.length, step.length, None, store + extra_bytes))
