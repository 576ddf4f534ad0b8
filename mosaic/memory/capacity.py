"""Planning without running: templates of a model (meta weights) for a key, and their plans."""

from __future__ import annotations

import torch

from ..config import GenerationConfig
from ..models.layers import Chunks
from .planner import PLANNERS, align, plan


def probe_step(model, n_tokens: int, n_masked: int, gen: GenerationConfig | None = None,
               batch: int = 1):
    """A Step of n_tokens per sequence with n_masked masked slots, on meta tensors (no memory)."""
    from ..engine.reducers import DreamReducer, LLaDAReducer
    from ..engine.runners import make_step
    gen = gen or GenerationConfig()
    meta = torch.device("meta")
    ids = torch.empty(batch, n_tokens, dtype=torch.long, device=meta)
    step = make_step(model, ids, None)
    step.rows = torch.empty(n_masked, dtype=torch.long, device=meta)
    if model.cfg.family == "dream":
        step.reducer = DreamReducer(gen, None, with_confidence=gen.alg != "origin")
    else:
        step.reducer = LLaDAReducer(model.cfg, gen, [], batch * n_tokens, None, meta)
    return step


def runner_for(model, planner="greedy-size", target="cuda", logits_kernel="auto"):
    from ..engine.runners import PlannedRunner
    r = PlannedRunner(model, planner, logits_kernel=logits_kernel)
    r.record_device = torch.device(target)
    return r


def plan_report(model, n_tokens: int, n_masked: int, planners=PLANNERS[:4],
                chunks: Chunks = Chunks(), target: str = "cuda") -> dict:
    """Every planner's total and time on one template, with LOAD (the lower bound)."""
    runner = runner_for(model, target=target)
    step = probe_step(model, n_tokens, n_masked)
    tpl, rec_ms, _ = runner.template(step, chunks)
    sizes = [align(b.nbytes) for b in tpl.buffers]
    starts, ends = [b.start for b in tpl.buffers], [b.end for b in tpl.buffers]
    rows = []
    for name in planners:
        p = plan(sizes, starts, ends, name)
        rows.append({"planner": name, "plan_bytes": p.total_bytes, "load_bytes": p.load_bytes,
                     "over_load": p.over_load, "plan_ms": p.plan_ms, "optimal": p.optimal})
    return {"model": model.name, "tokens": n_tokens, "masked": n_masked,
            "chunks": list(chunks.as_tuple()), "num_buffers": len(tpl.buffers),
            "num_ops": tpl.num_ops, "record_ms": rec_ms, "external_bytes": tpl.external_peak(),
            "peak_op": tpl.op_names[tpl.peak_op()], "planners": rows}
