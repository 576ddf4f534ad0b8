"""Runners turn a canvas into model outputs: the native one into full logits, the planned one
into per-masked-row reductions computed inside one planned workspace."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from ..graph.ctx import EagerCtx
from ..graph.record import RecordCtx, Template
from ..memory import planner as PL
from ..models.layers import Chunks, Step, step_program
from .executor import PlannedCtx


def make_step(model, ids: torch.Tensor, valid: torch.Tensor | None) -> Step:
    """Positions and masks as each family's reference builds them for (left-)padded batches."""
    B, L = ids.shape
    cfg = model.cfg
    padded = valid is not None and not bool(valid.all())
    pos = torch.arange(L, device=ids.device).expand(B, L)
    if padded:
        pads = tuple(int(p) for p in (~valid).sum(1).tolist())
        assert all(bool(valid[i, p:].all()) for i, p in enumerate(pads)), "padding must be on the left"
    if cfg.family == "dream" and padded:
        pos = valid.long().cumsum(-1) - 1
        pos = pos.masked_fill(~valid, 1)
        return Step(ids, pos, pads=pads, zero_pad_rows=True)
    if cfg.family == "llada" and padded:  # pads are masked as keys only; positions count them
        return Step(ids, pos, pads=pads)
    return Step(ids, pos)                  # LLaDA-MoE ignores the attention mask entirely


class NativeRunner:
    """The published forward: logits for every position from PyTorch's own allocator."""

    def __init__(self, model):
        self.model = model
        self.probe = None

    def forward(self, ids, valid):
        B, L = ids.shape
        step = make_step(self.model, ids, valid)
        ctx = EagerCtx(self.model.device, self.model.dtype)
        ctx.probe = self.probe
        return step_program(ctx, self.model, step).view(B, L, -1)


@dataclass
class StepStats:
    key: tuple
    chunks: tuple[int, int, int]
    plan_bytes: int
    load_bytes: int
    external_bytes: int
    plan_ms: float
    record_ms: float
    cached: bool


@dataclass
class PlannedRunner:
    model: object
    planner: str = "greedy-size"
    arena: object = None
    chooser: object = None            # chunk choice: fixed counts or the lazy search
    sanitize: bool = False
    logits_kernel: str = "auto"
    attention: str = "sdpa"             # see kernels.prefer_cudnn_attention
    templates: dict = field(default_factory=dict)
    plans: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    caps: dict = field(default_factory=dict)
    record_device: torch.device | None = None   # plan for another device (capacity planning)
    probe: object = None
    after_step: object = None

    def base_key(self, step: Step) -> tuple:
        B, L = step.ids.shape
        r = step.reducer
        return (B, L, r.signature(), r.fused is not None, step.rows_uncond is not None,
                step.pads, step.zero_pad_rows, step.shard)

    def key(self, step: Step, chunks: Chunks) -> tuple:
        return self.base_key(step) + (int(step.rows.shape[0]), chunks.as_tuple())

    def template(self, step: Step, chunks: Chunks) -> tuple[Template, float, bool]:
        step.chunks = chunks
        key = self.key(step, chunks)
        if key in self.templates:
            return self.templates[key], 0.0, True
        t0 = time.perf_counter()
        ctx = RecordCtx(self.record_device or self.model.device, self.model.dtype)
        ctx.logits_kernel = self.logits_kernel
        step_program(ctx, self.model, step)
        tpl = ctx.template()
        if len(self.templates) >= 512:  # the chunk search records many; keep the recent ones
            self.templates.pop(next(iter(self.templates)))
        self.templates[key] = tpl
        return tpl, (time.perf_counter() - t0) * 1e3, False

    def plan(self, tpl: Template, key) -> PL.Plan:
        pk = (key, self.planner)
        if pk not in self.plans:
            if len(self.plans) >= 512:
                self.plans.pop(next(iter(self.plans)))
            bufs = tpl.buffers
            self.plans[pk] = PL.plan([PL.align(b.nbytes) for b in bufs], [b.start for b in bufs],
                                     [b.end for b in bufs], self.planner)
        return self.plans[pk]

    def capped(self, step: Step) -> Step:
        """The step to plan for: masked counts fall during a request, so the plan made for the
        largest count seen (with the same shape) serves every later step (its buffers are
        views of at most the planned size); a larger count re-plans."""
        M = int(step.rows.shape[0])
        base = self.base_key(step)
        cap = max(self.caps.get(base, 0), M)
        self.caps[base] = cap
        if cap == M:
            return step
        meta = torch.empty(cap, dtype=torch.long, device="meta")
        return dataclasses.replace(step, rows=meta,
                                   rows_uncond=None if step.rows_uncond is None else meta)

    def prepare(self, step: Step):
        """Choose chunk counts, record and plan: everything but running. Returns (template, plan)."""
        t0 = time.perf_counter()
        planned = self.capped(step)
        chunks = self.chooser(self, planned) if self.chooser else Chunks()
        tpl, rec_ms, cached = self.template(planned, chunks)
        step.chunks = chunks
        key = self.key(planned, chunks)
        plan = self.plan(tpl, key)
        self.history.append(StepStats(key, chunks.as_tuple(), plan.total_bytes, plan.load_bytes,
                                      tpl.external_peak(), (time.perf_counter() - t0) * 1e3,
                                      rec_ms, cached))
        return tpl, plan

    def run_rows(self, ids, valid, rows, rows_uncond, reducer, shard=None) -> dict[str, torch.Tensor]:
        if rows.shape[0] == 0 and shard is None:  # ranks of a shard all run (collectives)
            return {k: torch.empty(0, dtype=dt, device=ids.device)
                    for k, dt in reducer.outputs(self.model.dtype)}
        if rows_uncond is not None and valid is not None:
            valid = torch.cat([valid, valid])
        step = make_step(self.model, ids, valid)
        step.rows, step.rows_uncond, step.reducer, step.shard = rows, rows_uncond, reducer, shard
        tpl, plan = self.prepare(step)
        self.arena.ensure(plan.total_bytes)
        ctx = PlannedCtx(self.model.device, self.model.dtype, tpl, plan, self.arena.tensor(),
                         sanitize=self.sanitize, logits_kernel=self.logits_kernel)
        ctx.probe, ctx.attention_kernel = self.probe, self.attention
        outs = step_program(ctx, self.model, step)
        outs = {k: v.clone() for k, v in outs.items()}
        if self.after_step:
            self.after_step(tpl, plan)
        return outs
