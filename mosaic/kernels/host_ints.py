"""Small host-known integers (row offsets, positions, entry bounds) onto the device without making
the host wait for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory with a blocking copy, and
PyTorch's blocking host-to-device copy synchronises the stream (Copy.cu: memcpy_and_sync): the host
waits for every kernel queued before it. A stacked step builds four or five such tensors (its
BatchIndex, its positions) right after the previous round's step was queued, so each round waited
for the previous step to finish before it could queue the next one. Staged through pinned memory
and copied non-blocking, the copy is queued behind that work instead; PyTorch's caching host
allocator keeps the pinned block until the copy has run (it records an event on the stream), so
the staging buffer is never reused early. Outside CUDA the tensor is the host tensor itself."""

from __future__ import annotations

from functools import lru_cache

import torch


def ints_on(values, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """values (a list of Python ints, or a host tensor) as a `dtype` tensor on `device`, queued
    behind the stream's work on CUDA (module docstring): never a host-device synchronisation."""
    device = torch.device(device)
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu" or device.type != "cuda":
            return values.to(device=device, dtype=dtype)
        host = values.to(dtype).pin_memory()
    elif device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


@lru_cache(maxsize=128)
def repeated_on(values: tuple, counts: tuple, device: torch.device) -> torch.Tensor:
    """[sum(counts)] int64 on device: values[i] repeated counts[i] times (a stacked step's row
    offsets, or its rows' request index), queued as ints_on does. Cached per (values, counts):
    read-only, shared by every round of one membership."""
    return ints_on([v for v, c in zip(values, counts) for _ in range(c)], device)
