"""A block cache's fill in slices of layers (chunked joining: engine/scheduler.py, engine/fills.py).

A fill (models/kv_cache.py, mode "fill") runs the whole sequence through every layer, writing
each layer's K and V into the request's store, then reduces the masked rows in the tail. Slice
[a, b) of it runs layers a .. b-1 of exactly that program on the residual stream x [B*L, d],
which lives outside the plan between slices (the request's, like its store): the first slice
embeds into it, the last one runs the tail. Every op is the fill's own, on the same values, so
the K/V and the tokens are the unchunked fill's (at the same chunk counts:
tests/engine/test_chunked_join.py). A fill cannot be sliced by positions instead: attention is
bidirectional, so every position of layer l reads every position of layer l - 1."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import CacheStep, _cached_attention
from .layers import run_layers, tail
from .step import Step


class Residual:
    """The residual stream x [B*L, d] of a fill between its slices (None until the first)."""

    def __init__(self, x: torch.Tensor | None = None):
        self.x = x


@dataclass(frozen=True)
class FillSlice:
    """Layers [a, b) of the fill `base` (a CacheStep of mode "fill" with its store) out of
    num_layers; residual: the stream between slices (None while planning); resident_bytes: the
    store's device bytes plus the residual's (admission and chunking charge them)."""
    base: CacheStep
    a: int
    b: int
    num_layers: int
    residual: Residual | None = None
    resident_bytes: int = 0
    capturable = False    # its residual is a new tensor per fill: a captured graph would keep the old address

    mode = "fill"
    index = None          # a fill has no batched block index (models/batched_attention.py)

    @property
    def store(self):
        return self.base.store

    @property
    def lo(self) -> int:
        return self.base.lo

    @property
    def hi(self) -> int:
        return self.base.hi

    @property
    def length(self) -> int:
        return self.base.length

    def key(self) -> tuple:
        """A template depends on the layers the slice runs, and whether it embeds and ends."""
        return (*self.base.key(), "slice", self.a, self.b, self.num_layers)

    def where(self) -> tuple:
        return (*self.base.where(), "slice", self.a, self.b)

    def sequence_kv(self, ctx, layer: int, batch: int, kv_dim: int) -> list[tuple]:
        return self.base.sequence_kv(ctx, layer, batch, kv_dim)

    def release_layer(self, ctx, layer: int) -> None:
        self.base.release_layer(ctx, layer)

    @property
    def program(self):
        """The step program of a slice (models/kv_cache.program_for asks)."""
        return fill_slice_program


def fill_slice_program(ctx, model, step: Step):
    """[embed, if a = 0] -> layers [a, b) of the fill -> [the tail, if b = num_layers: the
    per-slot outputs; else {}]."""
    spec = step.cache
    cfg = model.cfg
    ctx.set_phase("embed")
    shape = (step.batch * step.length, cfg.hidden)
    x = spec.residual.x if ctx.compute else torch.empty(shape, dtype=ctx.dtype, device="meta")
    if spec.a == 0:
        ctx.embed("x", step.ids.reshape(-1), model.embed, out=x, scale=model.extra.get("embed_scale"))
    run_layers(ctx, model, x, step, _cached_attention, span=(spec.a, spec.b))
    if spec.b < spec.num_layers:
        return {}
    return tail(ctx, model, x, x, step)
