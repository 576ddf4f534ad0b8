"""Step variants for the offload measurements (bench/suites/offload.py): attention computed for
the first query chunks of a step only, and streamed K/V written back without the overlap."""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial


class AttentionSample:
    """Compute attention for the first `keep` query chunks of a step only (module docstring):
    SDPA (R.attention), Mosaic's Triton kernel (A.attention_into) and the streamed K/V blocks
    (stream_attention, whose own kernel calls pass through)."""

    def __init__(self, keep=2):
        import mosaic.graph.ctx as C
        import mosaic.graph.stream_ops as S
        self.C, self.S, self.keep, self.calls, self.inside = C, S, keep, 0, False
        self.orig = (C.R.attention, C.A.attention_into, S.stream_attention)

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

    def __enter__(self):
        self.C.R.attention, self.C.A.attention_into, self.S.stream_attention = (self._wrap(f) for f in self.orig)
        return self

    def __exit__(self, *exc):
        self.C.R.attention, self.C.A.attention_into, self.S.stream_attention = self.orig


@contextmanager
def without_overlap(on: bool = True):
    """Streamed-K/V steps admitted inside write K and V back through one device chunk buffer
    (Offload.kv_write_slots = 1: every copy waits before the next chunk), the schedule before
    the overlap."""
    import mosaic.policy.offload as P
    orig = P.Offload
    if on:
        P.Offload = partial(orig, kv_write_slots=1)
    try:
        yield
    finally:
        P.Offload = orig
