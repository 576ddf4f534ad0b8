"""HostArena: an allocation the host cannot make (no budget, so the plan is unchunked) becomes
one MemoryBudgetError naming the bytes, not the allocator's RuntimeError."""

import pytest
import torch

from mosaic.errors import MemoryBudgetError
from mosaic.memory.arena import HostArena


def test_failed_host_allocation_is_a_budget_error(monkeypatch):
    def refuse(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")

    arena = HostArena("cpu")
    monkeypatch.setattr(torch, "empty", refuse)
    with pytest.raises(MemoryBudgetError, match="could not be allocated.*memory budget"):
        arena.ensure(3 * 2**30)


def test_other_errors_pass_through(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("something else")

    monkeypatch.setattr(torch, "empty", broken)
    with pytest.raises(RuntimeError, match="something else"):
        HostArena("cpu").ensure(10)
