"""Recorded templates and their plans, cached per key: the mechanism under every prepare.

A key is everything a step's buffer sizes depend on: batch, length, the reducer's signature,
whether the fused kernel runs, cfg pairs, padding, the shard, the masked count and the chunk
counts. Recording a key runs the step program on meta tensors (graph/record.py); planning it
places every buffer (memory/planner.py)."""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from .. import kernels
from ..graph.record import RecordCtx, Template
from ..memory import planner as PL
from ..models.kv_cache import program_for
from ..models.step import Chunks, Step

CACHE_ENTRIES = 512  # the chunk search records many templates; keep the recent ones


class TemplateCache:
    """Templates and plans of one model, keyed by step shape.

    record_device: the device whose kernel choices the templates follow (a CPU can plan for a
    GPU: capacity planning); planner: one of memory.planner.PLANNERS; batch_invariant: the
    templates of EngineConfig.batch_invariant's ops (their workspaces); moe_kernel: the routed
    experts' kernel setting (its buffers differ by kernel: kernels.moe_kernel); elementwise_kernel:
    the runner's setting (RMSNorm's one-pass kernel plans no scratch: kernels.rmsnorm_kernel)."""

    def __init__(self, model, planner: str = "greedy-size", logits_kernel: str = "auto",
                 attention: str = "sdpa", record_device: torch.device | None = None,
                 batch_invariant: bool = False, moe_kernel: str = "auto", elementwise_kernel: str = "auto"):
        self.model, self.planner = model, planner
        self.moe_kernel, self.elementwise_kernel = moe_kernel, elementwise_kernel
        self.batch_invariant = batch_invariant
        self.logits_kernel, self.attention = logits_kernel, attention
        self.record_device = torch.device(record_device) if record_device is not None else model.device
        self._templates: OrderedDict = OrderedDict()
        self._plans: OrderedDict = OrderedDict()

    def clear(self) -> None:
        """Forget every template and plan (an engine that is closed)."""
        self._templates.clear()
        self._plans.clear()

    def fused(self, step: Step) -> bool:
        """Whether this step's logits run through the fused Triton kernel."""
        r = step.reducer
        return (r is not None and r.fused is not None and step.rows_uncond is None
                and kernels.want_triton(self.record_device.type, self.logits_kernel))

    def base_key(self, step: Step) -> tuple:
        r = step.reducer
        key = (step.batch, step.length, r.signature(), self.fused(step), step.rows_uncond is not None,
               step.pads, step.zero_pad_rows, step.shard, step.sparse, step.offload)
        return key if step.cache is None else key + (step.cache.key(),)   # block-cache steps

    def key(self, step: Step, chunks: Chunks) -> tuple:
        return self.base_key(step) + (step.num_masked, chunks.as_tuple())

    def template(self, step: Step, chunks: Chunks) -> tuple[Template, float, bool]:
        """(template, milliseconds spent recording, whether it came from the cache)."""
        key = self.key(step, chunks)
        if key in self._templates:
            return self._templates[key], 0.0, True
        t0 = time.perf_counter()
        ctx = RecordCtx(self.record_device, self.model.dtype, logits_kernel=self.logits_kernel,
                        attention_kernel=self.attention, batch_invariant=self.batch_invariant,
                        moe_kernel=self.moe_kernel, elementwise_kernel=self.elementwise_kernel)
        program_for(step)(ctx, self.model, step.with_(chunks=chunks))
        tpl = ctx.template()
        _put(self._templates, key, tpl)
        return tpl, (time.perf_counter() - t0) * 1e3, False

    def get(self, key) -> Template | None:
        """The cached template of a key (None if it was never recorded or was evicted)."""
        return self._templates.get(key)

    def plan(self, tpl: Template, key) -> PL.Plan:
        pk = (key, self.planner)
        if pk not in self._plans:
            bufs = tpl.buffers
            _put(self._plans, pk, PL.plan([PL.align(b.nbytes) for b in bufs], [b.start for b in bufs],
                                          [b.end for b in bufs], self.planner))
        return self._plans[pk]

    def need_bytes(self, step: Step, chunks: Chunks) -> int:
        """Plan bytes + the largest out-of-plan allocation of any op, for these chunk counts."""
        tpl, _, _ = self.template(step, chunks)
        return self.plan(tpl, self.key(step, chunks)).total_bytes + tpl.external_peak()


def _put(cache: OrderedDict, key, value) -> None:
    if len(cache) >= CACHE_ENTRIES:
        cache.popitem(last=False)
    cache[key] = value
