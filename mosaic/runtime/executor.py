"""Run a recorded program with every activation a view of one arena at its planned offset.

The sanitizer (tests) fills each buffer's bytes with a poison pattern when the plan says it
dies, fails when an op reads a poisoned value, and checks at bind time that no two co-live
buffers overlap."""

from __future__ import annotations

import torch

from ..graph.ctx import Ctx
from ..graph.record import Template
from ..memory.planner import Plan, overlaps

POISON_BYTE = 0xA5
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class SanitizerError(AssertionError):
    pass


def _poison_value(itemsize: int) -> int:
    v = int.from_bytes(bytes([POISON_BYTE]) * itemsize, "little", signed=True)
    return v if itemsize > 1 else POISON_BYTE


class PlannedCtx(Ctx):
    def __init__(self, device, dtype, template: Template, plan: Plan, arena: torch.Tensor,
                 sanitize: bool = False, **kw):
        super().__init__(device, dtype, **kw)
        assert arena.dtype == torch.uint8 and arena.numel() >= plan.total_bytes, \
            (arena.numel(), plan.total_bytes)
        self.t, self.plan, self.arena = template, plan, arena
        self.sanitize = sanitize
        self._lookup = {(b.segment, b.seg_index): b for b in template.buffers}
        self._dying: dict[int, list] = {}
        self._dying_at_exit: dict[str, list] = {}
        last = template.num_ops - 1
        for b in template.buffers if sanitize else ():
            if b.end == last:  # what dies at the last op is the step's output, read after it
                continue
            # a buffer from outside a loop that dies inside it is read by every replayed
            # iteration: it dies when the outermost such loop exits, not at its last op index
            outer = [seg for seg, (lo, hi) in template.loops.items() if lo <= b.end < hi
                     and not (b.segment == seg or b.segment.startswith(seg + "/"))]
            if outer:
                self._dying_at_exit.setdefault(min(outer, key=len), []).append(b)
            else:
                self._dying.setdefault(b.end, []).append(b)
        self.external_peak = 0
        if sanitize:
            bad = overlaps(plan.offsets, [b.nbytes for b in template.buffers],
                           [b.start for b in template.buffers], [b.end for b in template.buffers])
            if bad:
                names = [(template.buffers[i].name, template.buffers[j].name) for i, j in bad[:5]]
                raise SanitizerError(f"plan overlaps co-live buffers: {names}")
            arena[: plan.total_bytes].fill_(POISON_BYTE)

    def new(self, name, shape, dtype=None):
        dtype = dtype or self.dtype
        seg = self._segs[-1]
        key = (seg, self._count.get(seg, 0))
        self._count[seg] = key[1] + 1
        b = self._lookup.get(key)
        assert b is not None and b.name == name and b.dtype == dtype, \
            f"program diverged from its template at {key}: {name} vs {b}"
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        assert nbytes <= b.nbytes, f"{name}: {nbytes} bytes > planned {b.nbytes}"
        off = self.plan.offsets[b.index]
        return self.arena[off: off + nbytes].view(dtype).view(tuple(shape))

    def _iteration(self, seg, i):
        super()._iteration(seg, i)
        self.n_ops = self.t.loops[seg][0]   # replay the recorded iteration's op indices

    def _exit(self, seg):
        self.n_ops = self.t.loops[seg][1]
        super()._exit(seg)
        if self.sanitize:
            self._poison(self._dying_at_exit.get(seg, ()))

    def _poison(self, bufs):
        for b in bufs:
            off = self.plan.offsets[b.index]
            self.arena[off: off + b.nbytes].fill_(POISON_BYTE)

    def external(self, nbytes):
        self.external_peak = max(self.external_peak, nbytes)

    def use(self, *reads, writes=()):
        if not self.sanitize:
            return
        for t in reads:
            if t is None or not self._in_arena(t):
                continue
            bits = t.view(_INT[t.element_size()]) if t.dtype != torch.bool else t.view(torch.uint8)
            if bool((bits == _poison_value(t.element_size())).any()):
                name = self.t.op_names[self.cur]
                raise SanitizerError(f"op {self.cur} ({name}) reads a dead buffer's bytes")

    def _in_arena(self, t) -> bool:
        a = self.arena.data_ptr()
        return a <= t.data_ptr() < a + self.arena.numel()

    def _done(self):
        if not self.sanitize:
            return
        self._poison(self._dying.get(self.cur, ()))
