"""The sanitizer catches what it is there to catch."""

import pytest
import torch
from conftest import random_model

from mosaic.engine.executor import PlannedCtx, SanitizerError
from mosaic.engine.runners import PlannedRunner
from mosaic.memory.arena import HostArena
from mosaic.memory.capacity import probe_step
from mosaic.memory.planner import Plan
from mosaic.models.layers import Chunks, step_program


def test_sanitizer_rejects_overlapping_plan():
    model = random_model("llada")
    runner = PlannedRunner(model, arena=HostArena("cpu"))
    step = probe_step(model, 16, 8)
    tpl, _, _ = runner.template(step, Chunks())
    bad = Plan(tuple(0 for _ in tpl.buffers), max(b.nbytes for b in tpl.buffers), 0, "zero", 0.0)
    with pytest.raises(SanitizerError, match="overlaps co-live buffers"):
        PlannedCtx("cpu", torch.float32, tpl, bad, torch.empty(bad.total_bytes, dtype=torch.uint8),
                   sanitize=True)


def test_sanitizer_catches_read_of_a_dead_buffer():
    model = random_model("llada")
    runner = PlannedRunner(model, arena=HostArena("cpu"))
    ids = torch.randint(0, 30, (1, 12))
    from mosaic.config import GenerationConfig
    from mosaic.engine.reducers import LLaDAReducer
    from mosaic.engine.runners import make_step
    step = make_step(model, ids, None)
    step.rows = torch.arange(6, 12)
    step.reducer = LLaDAReducer(model.cfg, GenerationConfig(), [], 12, None, torch.device("cpu"))
    tpl, plan = runner.prepare(step)
    # shorten the residual stream's life: it is read later, after its bytes were poisoned
    x = next(b for b in tpl.buffers if b.name == "x")
    early = [b if b is not x else type(b)(**{**b.__dict__, "end": b.start}) for b in tpl.buffers]
    tpl.buffers[:] = early
    arena = torch.empty(plan.total_bytes, dtype=torch.uint8)
    ctx = PlannedCtx("cpu", torch.float32, tpl, plan, arena, sanitize=True)
    with pytest.raises(SanitizerError, match="reads a dead buffer"):
        step_program(ctx, model, step)
