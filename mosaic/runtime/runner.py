"""Runners turn a canvas into model outputs: the native one into full logits, the planned one
into per-masked-row reductions computed inside one planned workspace."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from .. import kernels
from ..errors import StepInterrupted
from ..graph.ctx import EagerCtx
from ..graph.record import Template
from ..graph.streams import CopyEngine, HostPool
from ..memory.planner import Plan
from ..models.kv_cache import program_for
from ..models.layers import step_program
from ..models.step import Chunks, Step, make_step
from .executor import PlannedCtx
from .graph_rules import HOST_FLAGS
from .graphs import eligible


class NativeRunner:
    """The published forward: logits for every position from PyTorch's own allocator."""

    def __init__(self, model, attention: str = "sdpa"):
        self.model, self.attention = model, attention

    def forward(self, ids: torch.Tensor, valid: torch.Tensor | None, probe=None) -> torch.Tensor:
        """ids [B, L] int64, valid [B, L] bool or None -> logits [B, L, V] in the model dtype.

        probe(ctx, op_name) is called after every op (measurement only)."""
        B, L = ids.shape
        step = make_step(self.model.cfg, ids, valid, dtype=self.model.dtype)
        ctx = EagerCtx(self.model.device, self.model.dtype, attention_kernel=self.attention, probe=probe,
                       moe_kernel="loop")   # the published structure: one expert at a time
        return step_program(ctx, self.model, step).view(B, L, -1)


@dataclass(frozen=True)
class Prepared:
    """Everything a planned step needs but its data: the step as planned (masked count capped
    to the request's largest, chunk counts chosen), its template and plan.

    need_bytes = plan bytes + the largest out-of-plan allocation of any op."""
    step: Step
    chunks: Chunks
    template: Template
    plan: Plan
    key: tuple
    fused: bool
    record_ms: float = 0.0
    prepare_ms: float = 0.0
    cached: bool = False

    @property
    def plan_bytes(self) -> int:
        return self.plan.total_bytes

    @property
    def external_bytes(self) -> int:
        return self.template.external_peak()

    @property
    def need_bytes(self) -> int:
        return self.plan_bytes + self.external_bytes


class PlannedRunner:
    """Runs a prepared step with every activation a view of one arena.

    The budget's hooks (the engine's DeviceMemory): before_step(prepared), before the arena
    grows; stream(), the context a step runs in, eager or replayed (a budget with captured
    steps: the graphs' stream, memory/transient.py); scope(), a context the step's eager ops run
    in (pool reserved and PyTorch capped, transients allocated from the pool); on_step_done(
    prepared), after each step (PyTorch's cache trimmed there when no guard caps it)."""

    def __init__(self, model, arena, sanitize: bool = False, logits_kernel: str = "auto",
                 attention: str = "sdpa", on_step_done: Callable | None = None, elementwise_kernel: str = "auto",
                 copier=None, host_pool=None, before_step: Callable | None = None, scope: Callable | None = None,
                 graphs=None, batch_invariant: bool = False, stream: Callable | None = None,
                 moe_kernel: str = "auto"):
        self.model, self.arena, self.sanitize = model, arena, sanitize
        self.moe_kernel = moe_kernel
        self.batch_invariant = batch_invariant
        self.before_step, self.scope, self.stream = before_step, scope, stream
        self.graphs = graphs      # runtime/graphs.StepGraphs: captured steps (None: always eager)
        self.logits_kernel, self.attention = logits_kernel, attention
        self.elementwise_kernel = elementwise_kernel
        self.on_step_done = on_step_done
        # streamed steps (offload): one side stream and one host pool for the runner's life
        self.copier = copier or CopyEngine(model.device)
        self.host_pool = host_pool or HostPool(pin=model.device.type == "cuda")

    def execute(self, step: Step, prepared: Prepared, probe=None, interrupt=None) -> dict[str, torch.Tensor]:
        """Run `step` (its real row lists) on `prepared`'s plan; per-slot outputs, e.g.
        {"x0": [M] int64, "conf": [M]}, copied out of the arena. interrupt() is asked after every
        op of an eager step (a captured graph replays whole: milliseconds); True raises
        StepInterrupted once the device has finished what was queued (streamed copies included)."""
        if self.before_step is not None:
            self.before_step(prepared)
        self.arena.ensure(prepared.plan_bytes)
        with self.stream() if self.stream is not None else nullcontext():
            outs = self._run(step, prepared, probe, interrupt)
        # copied on the caller's stream, after the step's (the arena's next step overwrites them);
        # "ok", "drew" (a reducer's host-branch flags, runtime/graphs.py) stay here
        outs = {k: v.clone() for k, v in outs.items() if k not in HOST_FLAGS}
        if self.on_step_done:
            self.on_step_done(prepared)
        return outs

    def _run(self, step: Step, prepared: Prepared, probe, interrupt) -> dict[str, torch.Tensor]:
        g = self.graphs
        if g is not None and probe is None and not self.sanitize and g.allowed() and not self.moe_syncs() and \
                eligible(step, prepared, getattr(g.backend, "draw_problem", None) is None) is None:
            outs = g.run(step, prepared, lambda st: self.launch(st, prepared), self.arena.tensor().data_ptr())
            if outs is not None:
                return outs
        try:
            with self.scope() if self.scope is not None else nullcontext():
                return self.launch(step, prepared, probe, interrupt)
        except StepInterrupted:
            if self.model.device.type == "cuda":
                torch.cuda.synchronize(self.model.device)
            raise

    def moe_syncs(self) -> bool:
        """Whether this model's MoE experts run the per-expert loop, which reads its group sizes on
        the host (kernels.moe_kernel: CUDA outside bf16 on sm90 / sm100, batch-invariant mode):
        such a step cannot be captured, so it is not tried."""
        cfg = self.model.cfg
        if not cfg.num_experts:
            return False
        kernel = kernels.moe_kernel(self.model.device.type, self.model.dtype, self.moe_kernel, self.batch_invariant,
                                    (cfg.hidden, cfg.ffn))
        return kernel == "loop"

    def launch(self, step: Step, prepared: Prepared, probe=None, interrupt=None) -> dict[str, torch.Tensor]:
        """The step program on views of the arena; its outputs are arena views (not copied)."""
        ctx = PlannedCtx(self.model.device, self.model.dtype, prepared.template, prepared.plan,
                         self.arena.tensor(), sanitize=self.sanitize, logits_kernel=self.logits_kernel,
                         attention_kernel=self.attention, elementwise_kernel=self.elementwise_kernel,
                         probe=probe, copier=self.copier, host_pool=self.host_pool,
                         batch_invariant=self.batch_invariant, interrupt=interrupt, moe_kernel=self.moe_kernel)
        return program_for(step)(ctx, self.model, step.with_(chunks=prepared.chunks))
