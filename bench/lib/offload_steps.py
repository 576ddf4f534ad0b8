"""Step variants for the offload measurements (bench/suites/offload.py): attention computed for
the first query chunks of a step only, streamed K/V written back without the overlap, and a
probe that times a step per op without synchronising."""

from __future__ import annotations

import time
from contextlib import contextmanager
from functools import partial

import torch


class AttentionSample:
    """Compute attention for the first `keep` query chunks of a step only (module docstring):
    SDPA (R.attention), Mosaic's Triton kernel (A.attention_into), a query chunk streaming K/V
    back (stream_attention) and the first query chunk of a streamed-K/V layer, merged block by
    block as K and V are built (stream_ops.BlockMerge); the kernel calls inside the last two
    pass through."""

    def __init__(self, keep=2):
        import mosaic.graph.ctx as C
        import mosaic.graph.stream_ops as S
        self.C, self.S, self.keep, self.calls, self.inside = C, S, keep, 0, False
        self.orig = (C.R.attention, C.A.attention_into, S.stream_attention, S.BlockMerge)

    def _wrap(self, fn):
        def run(*a, **k):
            if self.inside:
                return fn(*a, **k)
            self.calls += 1
            if self.calls > self.keep:
                return None
            self.inside = True
            try:
                return fn(*a, **k)
            finally:
                self.inside = False
        return run

    def _merge(self, base):
        sample = self

        class Sampled(base):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                sample.calls += 1
                self.skip = sample.calls > sample.keep

            def add(self, k, v):
                if not self.skip:
                    sample.inside = True
                    try:
                        super().add(k, v)
                    finally:
                        sample.inside = False

            def finish(self, out):
                if not self.skip:
                    super().finish(out)
        return Sampled

    def __enter__(self):
        C, S = self.C, self.S
        C.R.attention, C.A.attention_into, S.stream_attention = (self._wrap(f) for f in self.orig[:3])
        S.BlockMerge = self._merge(self.orig[3])
        return self

    def __exit__(self, *exc):
        self.C.R.attention, self.C.A.attention_into, self.S.stream_attention, self.S.BlockMerge = self.orig


@contextmanager
def without_overlap(on: bool = True):
    """Streamed-K/V steps admitted inside write K and V back through one device chunk buffer
    (Offload.kv_write_slots = 1: the compute stream waits for every copy as it is issued), the
    schedule before the overlap."""
    import mosaic.policy.offload as P
    orig = P.Offload
    if on:
        P.Offload = partial(orig, kv_write_slots=1)
    try:
        yield
    finally:
        P.Offload = orig


class OpTimes:
    """A step probe: where the compute stream's time goes, per op name (ms). On CUDA it records
    an event on the current stream after every op without synchronising (the side stream's
    copies keep overlapping; a wait for a copy counts in the op that waits), on a CPU the wall
    clock; each interval is charged to the op that ends it."""

    def __init__(self, device="cuda"):
        self.cuda = torch.device(device).type == "cuda"
        self.marks: list[tuple[str, object]] = [("start", self._now())]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def __call__(self, ctx, name):
        self.marks.append((name, self._now()))

    def ms(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            dt = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
            out[name] = out.get(name, 0.0) + dt
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))
