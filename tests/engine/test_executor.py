"""The sanitizer catches what it is there to catch."""

import pytest
import torch
from conftest import random_model

from mosaic.config import GenerationConfig
from mosaic.memory.planner import Plan
from mosaic.models.layers import step_program
from mosaic.models.step import Chunks, make_step
from mosaic.policy.prepare import Preparer
from mosaic.policy.probe import probe_step
from mosaic.runtime.executor import PlannedCtx, SanitizerError
from mosaic.runtime.reducers import LLaDAReducer
from mosaic.runtime.templates import TemplateCache


def test_sanitizer_rejects_overlapping_plan():
    model = random_model("llada")
    step = probe_step(model, 16, 8)
    tpl, _, _ = TemplateCache(model).template(step, Chunks())
    bad = Plan(tuple(0 for _ in tpl.buffers), max(b.nbytes for b in tpl.buffers), 0, "zero", 0.0)
    with pytest.raises(SanitizerError, match="overlaps co-live buffers"):
        PlannedCtx("cpu", torch.float32, tpl, bad, torch.empty(bad.total_bytes, dtype=torch.uint8),
                   sanitize=True)


def test_sanitizer_catches_read_of_a_dead_buffer():
    model = random_model("llada")
    ids = torch.randint(0, 30, (1, 12))
    step = make_step(model.cfg, ids, None, rows=torch.arange(6, 12),
                     reducer=LLaDAReducer(model.cfg, GenerationConfig(), [], 12, None, torch.device("cpu")))
    prepared = Preparer(TemplateCache(model)).prepare(step)
    tpl, plan = prepared.template, prepared.plan
    # shorten the residual stream's life: it is read later, after its bytes were poisoned
    x = next(b for b in tpl.buffers if b.name == "x")
    early = [b if b is not x else type(b)(**{**b.__dict__, "end": b.start}) for b in tpl.buffers]
    tpl.buffers[:] = early
    arena = torch.empty(plan.total_bytes, dtype=torch.uint8)
    ctx = PlannedCtx("cpu", torch.float32, tpl, plan, arena, sanitize=True)
    with pytest.raises(SanitizerError, match="reads a dead buffer"):
        step_program(ctx, model, step)
