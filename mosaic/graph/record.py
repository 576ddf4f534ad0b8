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
    segment: str        # head | layer | tail
    seg_index: int      # allocation order inside its segment (the executor's lookup key)


@dataclass
class Template:
    """One step's buffers for one key (batch, length, masked count, chunk counts)."""
    buffers: list[Buffer]
    op_names: list[str]
    layer_ops: tuple[int, int]            # [start, end) op range of the one recorded layer
    external: list[int] = field(default_factory=list)  # bytes allocated outside the plan per op

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


class RecordCtx(Ctx):
    compute = False
    recording = True

    def __init__(self, device, dtype):
        super().__init__(device, dtype)
        self._bufs: list[dict] = []
        self._by_id: dict[int, dict] = {}
        self._keep: list[torch.Tensor] = []
        self._names: list[str] = []
        self._ext: list[int] = []
        self._segment, self._seg_count = "head", {"head": 0, "layer": 0, "tail": 0}
        self._layer_ops = (0, 0)

    def new(self, name, shape, dtype=None):
        dtype = dtype or self.dtype
        t = torch.empty(tuple(shape), dtype=dtype, device="meta")
        birth = self.cur if self.cur is not None else self.n_ops
        seg = self._segment
        rec = dict(index=len(self._bufs), name=name, shape=tuple(shape), dtype=dtype,
                   nbytes=t.numel() * t.element_size(), start=birth, end=birth, segment=seg,
                   seg_index=self._seg_count[seg])
        self._seg_count[seg] += 1
        self._bufs.append(rec)
        self._by_id[id(t)] = rec
        self._keep.append(t)
        return t

    def _use(self, *reads, writes=()):
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
        return super().op(name)

    def layers(self, layer_weights):
        # every layer runs the same ops on the same buffers: recording one is enough
        it = iter(layer_weights)
        first = next(it)
        self._layer(0)
        yield first
        self._layer(None)

    def _layer(self, index):
        if index == 0:
            self._segment, self._layer_start = "layer", self.n_ops
            return
        end = self.n_ops
        for rec in self._bufs:
            born_before = rec["start"] < self._layer_start and rec["segment"] == "head"
            if rec["segment"] == "layer":
                assert rec["end"] < end, f"layer buffer {rec['name']} outlives its layer"
            elif born_before and rec["end"] >= self._layer_start:
                rec["end"] = max(rec["end"], end - 1)  # read by every layer, not only the first
        self._layer_ops = (self._layer_start, end)
        self._segment = "tail"

    def template(self) -> Template:
        bufs = [Buffer(**r) for r in self._bufs]
        return Template(bufs, list(self._names), self._layer_ops, list(self._ext))


def record(program, *args, device="cpu", dtype=torch.bfloat16, **kwargs) -> Template:
    ctx = RecordCtx(device, dtype)
    program(ctx, *args, **kwargs)
    return ctx.template()
