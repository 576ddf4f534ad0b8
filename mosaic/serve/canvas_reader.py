"""The generated part of a request's canvas, read after every step without stalling the device.

A streaming request's text follows its canvas step by step. Reading a CUDA canvas with `.cpu()`
after step i waits for everything queued on the stream, and with the fast samplers' run-ahead
(runtime/samplers/fast_llada.py) step i+1 is already queued then: the host waits for step i+1,
and only then launches step i+2, so the device idles while the host decodes and streams. On the
H200 (LLaDA-8B dual 0.9, 1k + 128, one streaming client) the server's engine ran at 1.17 s
against generate()'s 0.965 s, 1.6 ms more per forward (bench/results/gpu/session7/
everyday_served_cebfa5a.json).

So on CUDA each step's ids are copied into one of two pinned host buffers asynchronously, after
an event, and handed back one step later (by then the device has passed that copy: the sampler
has read the next step's readback). The stream's text then trails the device by one step (a few
ms), and an early stop (the committed prefix ended the answer) comes one step later; the answer
is the same, since a committed position never changes. On the CPU the read is immediate."""

from __future__ import annotations

import torch


class CanvasReader:
    """push(i, canvas [1, L]) -> (step, ids [G] on the host) to act on now, or None; flush() ->
    the last step's, or None. start: the prompt length P (ids are canvas[0, P:]). lag: read one
    step late through pinned buffers (default: when the canvas is on CUDA)."""

    def __init__(self, start: int, lag: bool | None = None):
        self.start, self.lag = start, lag
        self.buffers: list[torch.Tensor] = []
        self.pending = None              # (step, host ids, event or None)
        self.turn = 0

    def push(self, i: int, canvas: torch.Tensor):
        ids = canvas[0, self.start:]
        lag = self.lag if self.lag is not None else ids.is_cuda
        if not lag:
            return i, ids.cpu()
        if not self.buffers:             # two buffers: one being filled, one being read
            pin = ids.is_cuda
            self.buffers = [torch.empty(ids.shape, dtype=ids.dtype, pin_memory=pin) for _ in range(2)]
        host = self.buffers[self.turn]
        self.turn ^= 1
        host.copy_(ids, non_blocking=True)
        event = None
        if ids.is_cuda:
            event = torch.cuda.Event()
            event.record()
        prev, self.pending = self.pending, (i, host, event)
        return self._ready(prev)

    def flush(self):
        prev, self.pending = self.pending, None
        return self._ready(prev)

    @staticmethod
    def _ready(got):
        if got is None:
            return None
        i, host, event = got
        if event is not None:
            event.synchronize()          # passed already in the run-ahead loop (module docstring)
        return i, host.clone()
