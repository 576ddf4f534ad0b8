"""The workspace every planned buffer is a view of.

HostArena is one plain byte tensor from PyTorch's allocator (the CPU path, and the GPU path
without virtual memory); VmmArena (vmm.py) maps physical pages under one reserved range."""

from __future__ import annotations

import torch

from ..errors import InputError, MemoryBudgetError, gib
from .planner import align
from .vmm import VmmArena, vmm_available


class HostArena:
    kind = "host"

    def __init__(self, device):
        self.device = torch.device(device)
        self._t: torch.Tensor | None = None
        self.peak_bytes = 0
        self.exact = False   # under a budget: exactly the plan, reallocated when it shrinks too

    def ensure(self, nbytes: int) -> None:
        if self._t is None or self._t.numel() < nbytes or \
                (self.exact and self._t.numel() != align(max(nbytes, 1))):
            self._t = None  # drop the old one first: old and new never coexist
            try:
                self._t = torch.empty(align(max(nbytes, 1)), dtype=torch.uint8, device=self.device)
            except (RuntimeError, MemoryError) as e:
                # a CPU run without a budget plans unchunked and can ask the host for more than
                # it has; on a GPU admission has already charged this arena against the budget
                if self.device.type != "cpu" or ("alloc" not in str(e).lower() and "memory" not in str(e).lower()):
                    raise
                raise MemoryBudgetError(
                    f"the step's workspace of {gib(nbytes)} could not be allocated on {self.device.type} "
                    f"({str(e).splitlines()[0][:120]}); set a memory budget so "
                    "the step is chunked to fit, or ask for fewer tokens", needed_bytes=nbytes,
                    budget_bytes=0) from None
            self.peak_bytes = max(self.peak_bytes, self._t.numel())

    def trim(self, nbytes: int) -> None:
        """Drop the buffer if it is larger than `nbytes` (ensure() makes the new one): a budget's
        guard calls this before a smaller plan, so old and new never coexist."""
        if self._t is not None and self._t.numel() > align(max(nbytes, 1)):
            self._t = None

    def tensor(self) -> torch.Tensor:
        assert self._t is not None, "ensure() before tensor()"
        return self._t

    @property
    def mapped_bytes(self) -> int:
        return 0 if self._t is None else self._t.numel()

    def close(self) -> None:
        self._t = None


def make_arena(device, kind: str = "auto"):
    device = torch.device(device)
    if kind == "vmm" or (kind == "auto" and device.type == "cuda"):
        if vmm_available():
            return VmmArena(device)
        if kind == "vmm":
            why = "a CUDA device" if device.type != "cuda" else "cuda-bindings (pip install mosaic-dllm[gpu])"
            raise InputError(f"the virtual-memory arena (arena 'vmm') needs {why} (here: {device}); "
                             "use arena 'auto' or 'host'")
    return HostArena(device)
