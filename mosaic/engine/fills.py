"""Running a block cache's fill in slices of layers across rounds (chunked joining).

The Scheduler (engine/scheduler.py) decides which fills run in slices and how many layers each
slice takes; this file only runs a slice: `FillSlices.run(run, a, b)` runs layers [a, b) of the
run's pending fill (models/fill_slices.py) and returns the call's outputs after its last slice
(None before). Between slices the run's residual stream x [B*L, d] is held here, in the model
dtype on the device (B*L*d*itemsize bytes: 9.4 MB for a 1,152-token LLaDA-8B fill in bf16),
charged with the store to the slice's step (FillSlice.resident_bytes) and freed after the last
slice or when the run leaves (drop)."""

from __future__ import annotations

import dataclasses

import torch

from ..graph.shard import world
from ..models.fill_slices import FillSlice, Residual
from ..models.kv_cache import cached_step
from ..runtime.samplers.base import RowsCall


def can_slice(engine, run) -> bool:
    """Whether the run's pending call is a fill that can run in slices: a block-cache fill of one
    canvas per row, without cfg, resident weights, a store wholly on the device, one process."""
    call = run.pending
    if not isinstance(call, RowsCall) or call.cache is None or call.cache.mode != "fill":
        return False
    if call.rows_uncond is not None or call.canvas_rows is not None or run.state.offload is not None:
        return False
    lay = run.state.store.layout
    return lay.hot >= lay.num_layers and world()[1] == 1 and engine.model.cfg.num_layers > 1


def fill_tokens(run) -> int:
    """Tokens the run's pending fill puts through every layer: B x L."""
    return int(run.pending.ids.numel())


class FillSlices:
    """The residual streams of the fills in flight, and the slices that run them."""

    def __init__(self, engine):
        self.engine = engine
        self.residuals: dict[int, Residual] = {}     # id(run) -> its fill's stream

    def run(self, run, a: int, b: int):
        """Layers [a, b) of the run's pending fill: its outputs after the last layer, else None.
        RequestCancelled if the run was cancelled (before the slice or inside it)."""
        run.check_cancelled()
        model, call, state = self.engine.model, run.pending, run.state
        num_layers = model.cfg.num_layers
        B, L = call.ids.shape
        if a == 0:
            self.residuals[id(run)] = Residual(torch.empty(B * L, model.cfg.hidden, dtype=model.dtype,
                                                           device=call.ids.device))
        residual = self.residuals[id(run)]
        store = state.store
        base = dataclasses.replace(call.cache, store=store, resident_bytes=store.layout.device_bytes)
        spec = FillSlice(base, a, b, num_layers, residual,
                         store.layout.device_bytes + residual.x.numel() * residual.x.element_size())
        step = cached_step(model.cfg, call.ids, state.valid, spec, rows=call.rows, reducer=call.reducer,
                           offload=None, dtype=model.dtype)
        store.begin(spec.mode, spec.lo, spec.hi)
        with run.interruptible():
            outs = self.engine.executor.execute(step, state)
        store.finish()
        if b < num_layers:
            return None
        self.drop(run)
        return outs

    def drop(self, run) -> None:
        """Free the stream of a run that finished its fill or left."""
        self.residuals.pop(id(run), None)
