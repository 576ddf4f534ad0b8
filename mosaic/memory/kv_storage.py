"""The paged K/V pool's buffers (memory/kv_pool.py): one tensor [layers, 2, capacity, kv_dim]
from PyTorch's allocator, grown by a new tensor and a copy (both alive until the copy ends, and
the address moves), exactly to the rows asked under a budget and at least doubled without one."""

from __future__ import annotations

import torch


class TensorStorage:
    """The pool's buffers as one tensor [layers, 2, capacity, kv_dim] (module docstring)."""

    def __init__(self, num_layers: int, kv_dim: int, dtype: torch.dtype, device, exact: bool = False):
        self.shape, self.dtype, self.device, self.exact = (num_layers, 2), dtype, torch.device(device), exact
        self.kv_dim = kv_dim
        self.t = torch.empty((num_layers, 2, 0, kv_dim), dtype=dtype, device=self.device)
        self.moves = 0
        self.peak_bytes = 0       # the most bytes held at once, the copy of a growth included

    @property
    def capacity(self) -> int:
        return self.t.shape[2]

    def wants(self, rows: int) -> int:
        """The capacity (rows) ensure(rows) leaves: `rows` exactly under a budget, else at
        least double; never less than now."""
        cap = self.capacity
        return cap if rows <= cap else (rows if self.exact else max(rows, 2 * cap))

    def row_bytes(self) -> int:
        return 2 * self.shape[0] * self.kv_dim * self.dtype.itemsize

    def ensure(self, rows: int, keep: int) -> None:
        """Hold at least `rows` rows (wants), keeping the first `keep`: a new tensor and a copy,
        both alive until the copy ends (peak_bytes)."""
        cap, want = self.capacity, self.wants(rows)
        if want == cap:
            return
        new = torch.empty((*self.shape, want, self.kv_dim), dtype=self.dtype, device=self.device)
        self.peak_bytes = max(self.peak_bytes, self.nbytes + new.numel() * new.element_size())
        k = min(keep, want, cap)
        new[:, :, :k].copy_(self.t[:, :, :k])
        self.t = new
        self.moves += 1

    def layer(self, i: int):
        return self.t[i, 0], self.t[i, 1]

    def release(self) -> None:
        self.t = torch.empty((*self.shape, 0, self.kv_dim), dtype=self.dtype, device=self.device)
        self.moves += 1

    def move(self, src: int, dst: int, rows: int) -> None:
        """Rows [src, src + rows) to [dst, dst + rows), dst < src: in pieces that never overlap."""
        step = src - dst
        for a in range(0, rows, step):
            n = min(step, rows - a)
            self.t[:, :, dst + a:dst + a + n].copy_(self.t[:, :, src + a:src + a + n])

    def zero(self, start: int, rows: int) -> None:
        self.t[:, :, start:start + rows].zero_()

    def address(self) -> tuple:
        return (self.t.data_ptr(), self.capacity, self.moves)

    @property
    def nbytes(self) -> int:
        return self.t.numel() * self.t.element_size()
