"""Record mode: run a program on meta tensors and keep every buffer's size and lifetime."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .ctx import Ctx


@dataclass(frozen=True)
class Buffer:
    index: int          # allocation order over the whole recording
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    start: int          # op that writes it first
    end: int            # op that reads it last (inclusive)
    segment: str        # "main" or a loop id ("main/0" the layer loop, "main/0/1" a chunk loop)
    seg_index: int      # allocation order inside its segment (the executor's lookup key)


@dataclass
class Template:
    """One step's buffers for one key (batch, length, masked count, chunk counts). Loops (the
    layers, every chunk loop) are recorded as one iteration that a run replays."""
    buffers: list[Buffer]
    op_names: list[str]
    loops: dict[str, tuple[int, int]]     # loop id -> [start, end) op range of its iteration
    external: list[int] = field(default_factory=list)  # bytes allocated outside the plan per op
    phases: list[str] = field(default_factory=list)    # phase of each op
    loop_counts: dict[str, int] = field(default_factory=dict)  # iterations of each loop
    host: dict[str, int] = field(default_factory=dict)  # host-memory buffers (name -> bytes), outside the plan

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def num_ops(self) -> int:
        return len(self.op_names)

    def live_bytes(self) -> list[int]:
        """Bytes live at each op (the planner's LOAD is their max)."""
        diff = [0] * (self.num_ops + 1)
        for b in self.buffers:
            diff[b.start] += b.nbytes
            diff[b.end + 1] -= b.nbytes
        out, run = [], 0
        for i in range(self.num_ops):
            run += diff[i]
            out.append(run)
        return out

    def load(self) -> int:
        return max(self.live_bytes(), default=0)

    def peak_op(self) -> int:
        live = self.live_bytes()
        return max(range(len(live)), key=live.__getitem__) if live else 0

    def external_peak(self) -> int:
        return max(self.external, default=0)

    def execution_order(self) -> list[int]:
        """Op indices as a run executes them: every loop's iteration replayed its count."""
        by_start: dict[int, list] = {}
        for seg, (lo, hi) in self.loops.items():
            by_start.setdefault(lo, []).append((hi - lo, seg, hi))

        def walk(lo, hi, inside):
            out, i = [], lo
            while i < hi:
                kids = [k for k in by_start.get(i, []) if k[1] not in inside and k[2] <= hi]
                if kids:
                    _, seg, end = max(kids)                  # the outermost loop starting here
                    body = walk(i, end, inside | {seg})
                    out += body * max(1, self.loop_counts.get(seg, 1))
                    i = end
                else:
                    out.append(i)
                    i += 1
            return out
        return walk(0, self.num_ops, frozenset())

    def phase_peaks(self) -> dict[str, int]:
        """Per phase, the most bytes (live in the plan + allocated outside it) at any of its ops."""
        out: dict[str, int] = {}
        for live, ext, ph in zip(self.live_bytes(), self.external, self.phases):
            out[ph] = max(out.get(ph, 0), live + ext)
        return out


class RecordCtx(Ctx):
    compute = False
    recording = True

    def __init__(self, device, dtype, **kw):
        super().__init__(device, dtype, **kw)
        self._bufs: list[dict] = []
        self._by_id: dict[int, dict] = {}
        self._keep: list[torch.Tensor] = []
        self._names: list[str] = []
        self._ext: list[int] = []
        self._phases: list[str] = []
        self._start: dict[str, int] = {}
        self._loop_ops: dict[str, tuple[int, int]] = {}
        self._counts: dict[str, int] = {}
        self._host: dict[str, int] = {}

    def host_new(self, name, shape, dtype=None):
        t = torch.empty(tuple(shape), dtype=dtype or self.dtype, device="meta")
        self._host[name] = max(self._host.get(name, 0), t.numel() * t.element_size())
        return t

    def new(self, name, shape, dtype=None):
        dtype = dtype or self.dtype
        t = torch.empty(tuple(shape), dtype=dtype, device="meta")
        birth = self.cur if self.cur is not None else self.n_ops
        seg = self._segs[-1]
        rec = dict(index=len(self._bufs), name=name, shape=tuple(shape), dtype=dtype,
                   nbytes=t.numel() * t.element_size(), start=birth, end=birth, segment=seg,
                   seg_index=self._count.get(seg, 0))
        self._count[seg] = rec["seg_index"] + 1
        self._bufs.append(rec)
        self._by_id[id(t)] = rec
        self._keep.append(t)
        return t

    def use(self, *reads, writes=()):
        for t in (*reads, *writes):
            if t is None:
                continue
            root = t if t._base is None else t._base
            rec = self._by_id.get(id(root))
            if rec is not None:
                rec["end"] = max(rec["end"], self.cur)

    def external(self, nbytes):
        self._ext[self.cur] += nbytes

    def op(self, name):
        self._names.append(name)
        self._ext.append(0)
        self._phases.append(self.phase)
        return super().op(name)

    def _enter(self, seg, count):
        super()._enter(seg, count)
        self._start[seg] = self.n_ops
        self._counts[seg] = count

    def _exit(self, seg):
        start, end = self._start[seg], self.n_ops
        for rec in self._bufs:
            inside = rec["segment"] == seg or rec["segment"].startswith(seg + "/")
            if inside:
                assert rec["end"] < end, f"{rec['name']} outlives its loop iteration"
            elif rec["end"] >= start:
                # read by every iteration: keep it alive over the whole replayed range
                rec["end"] = max(rec["end"], end - 1)
        self._loop_ops[seg] = (start, end)
        super()._exit(seg)

    def template(self) -> Template:
        bufs = [Buffer(**r) for r in self._bufs]
        return Template(bufs, list(self._names), dict(self._loop_ops), list(self._ext),
                        list(self._phases), dict(self._counts), dict(self._host))


def record(program, *args, device="cpu", dtype=torch.bfloat16, **kwargs) -> Template:
    ctx = RecordCtx(device, dtype)
    program(ctx, *args, **kwargs)
    return ctx.template()
