"""Fake CUDA streams for the schedule tests (tests/graph): a simulated clock, and copies that
happen only when the compute stream waits for them (docs/OFFLOAD.md)."""


def ptr(t):
    """Address of a tensor's first byte."""
    return t.data_ptr()


class Ev:
    def __init__(self, t, copies=()):
        self.t, self.copies = t, list(copies)


class FakeClock:
    """Two streams on a simulated clock (seconds); copies move `bw` bytes per second. log:
    ("copy", dst address, start, end, order, src address), ("compute", slot address, start, end,
    order)."""

    def __init__(self, bw: float = 1.0):
        self.bw, self.compute_t, self.side_t, self.log = bw, 0.0, 0.0, []

    def mark(self):
        return Ev(self.compute_t)

    def copy(self, pairs, after=None):
        nbytes = sum(d.numel() * d.element_size() for d, _ in pairs)
        start = max(self.side_t, after.t if after is not None else 0.0)
        self.side_t = start + nbytes / self.bw
        for d, s in pairs:
            d.copy_(s)
        self.log.append(("copy", ptr(pairs[0][0]), start, self.side_t, len(self.log), ptr(pairs[0][1])))
        return Ev(self.side_t)

    def wait(self, ev):
        if ev is not None:
            self.compute_t = max(self.compute_t, ev.t)

    def compute(self, seconds, slot_ptr):
        start = self.compute_t
        self.compute_t += seconds
        self.log.append(("compute", slot_ptr, start, self.compute_t, len(self.log)))


class LazyCopies:
    """Copies happen only when the compute stream waits for them (as late as CUDA may run them)."""

    def __init__(self):
        self.pending = []

    def mark(self):
        return None

    def copy(self, pairs, after=None):
        ev = Ev(0, pairs)
        self.pending.append(ev)
        return ev

    def wait(self, ev):
        if ev is None:
            return
        while self.pending:            # a stream runs in order: everything issued up to ev
            e = self.pending.pop(0)
            for d, s in e.copies:
                d.copy_(s)
            if e is ev:
                break


class NoWait(LazyCopies):
    def wait(self, ev):               # a broken schedule: compute never waits for its copy
        pass
