"""The workspace every planned buffer is a view of.

HostArena is one plain byte tensor from PyTorch's allocator (the CPU path, and the GPU path
without virtual memory); VmmArena (vmm.py) maps physical pages under one reserved range."""

from __future__ import annotations

import torch

from ..errors import InputError
from .planner import align
from .vmm import VmmArena, vmm_available


class HostArena:
    kind = "host"

    def __init__(self, device):
        self.device = torch.device(device)
        self._t: torch.Tensor | None = None
        self.peak_bytes = 0

    def ensure(self, nbytes: int) -> None:
        if self._t is None or self._t.numel() < nbytes:
            self._t = None  # drop the old one first: old and new never coexist
            self._t = torch.empty(align(max(nbytes, 1)), dtype=torch.uint8, device=self.device)
            self.peak_bytes = max(self.peak_bytes, self._t.numel())

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
