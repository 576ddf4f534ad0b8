"""A step's readback that does not wait for the device: the small [k, B] integer tensor a commit
leaves (tied rows, masks left, candidates) is copied into pinned host memory behind the step on
its stream, and an event marks the copy; `read()` waits for that event only, so work queued
after it (the next step, launched ahead: runtime/samplers/fast_llada.py) keeps the device busy.

Why: the blocking `.tolist()` of runtime/published.read_with_checks is a copy on the current
stream, so it waits for everything queued before it. Measured on an H200 (session 7, LLaDA-8B
dual block step, 1k prompt, block 32): 8.36 ms per forward wall against 6.72 ms of GPU, the
1.6 ms difference the host's sampler, scheduler round and next launch while the GPU idles.

The copy carries the NaN tests pending on this thread (runtime/published.defer_check), taken off
the thread's list at the start, so a test is read with its own step and never with a step
launched after it; `read()` raises their NumericsError. On the CPU the copy is the tensor itself
(no device to wait for)."""

from __future__ import annotations

import torch

from . import published as P


class Readback:
    """t [k, B] integers (any integer dtype), with this thread's pending NaN tests, on their way
    to the host. read() -> [k][B] Python ints (waits for the copy only); NumericsError when a
    test it carries is set. discard(): drop it (a step launched ahead whose result is not used)."""

    def __init__(self, t: torch.Tensor):
        self.checks = P.take_checks()
        self.k, self.B = t.shape
        flat = t.reshape(-1)
        if self.checks:          # one cat: it promotes the 0-d flags to t's integers
            flat = torch.cat([flat, *(f.to(t.device).reshape(1) for f, _ in self.checks)])
        flat = flat.long()
        self.event = None
        if flat.device.type == "cuda":
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
            flat = host
        self.flat = flat

    def read(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        vals = self.flat.tolist()
        n = self.k * self.B
        for bad, (_, dtype) in zip(vals[n:], self.checks):
            if bad:
                raise P.nan_error(dtype)
        return [vals[i:i + self.B] for i in range(0, n, self.B)]

    def discard(self) -> None:
        self.checks, self.flat = [], None
