"""Capacity planning without running: templates of a model (meta weights) and their plans,
and L_max, the longest request that fits a budget."""

from __future__ import annotations

import time

import torch

from ..config import parse_bytes
from ..errors import MemoryBudgetError, gib
from ..memory.accounting import (
    FIXED_BYTES,
    H200_CONTEXT_BYTES,
    INPUT_BYTES_PER_TOKEN,
    Budget,
    charged_fixed,
    floor_bytes_per_token,
)
from ..memory.planner import PLANNERS, align, plan
from ..models.step import Chunks
from ..runtime.templates import TemplateCache
from .admission import fit, longest
from .chunking import choose, chunk_policy
from .prepare import Preparer
from .probe import probe_step


def templates_for(model, planner="greedy-size", target="cuda", logits_kernel="auto") -> TemplateCache:
    """A template cache that records for `target` (a CPU plans for a GPU's kernel choices)."""
    return TemplateCache(model, planner, logits_kernel, record_device=torch.device(target))


def plan_report(model, n_tokens: int, n_masked: int, planners=PLANNERS[:4],
                chunks: Chunks = Chunks(), target: str = "cuda") -> dict:
    """Every planner's total and time on one template, with LOAD (the lower bound)."""
    tc = templates_for(model, target=target)
    step = probe_step(model, n_tokens, n_masked)
    tpl, rec_ms, _ = tc.template(step, chunks)
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


def capacity_preparer(model, budget: Budget, planner: str = "greedy-size", target: str = "cuda",
                      max_chunks: int = 4096, phases=None, logits_kernel: str = "auto") -> Preparer:
    """The Preparer the engine builds (templates for `target`, the lazy chunk search under the
    budget's activation limit), so that capacity and admission run one code path. phases: the
    phases the search may split (default all)."""
    tc = templates_for(model, planner, target, logits_kernel)
    limit = lambda step: budget.activation_limit(step.batch, step.length, step.shard_slots)  # noqa: E731
    policy = chunk_policy(None, limit, max_chunks) if phases is None else \
        (lambda tc_, step: choose(tc_, step, limit(step), max_chunks, phases))
    return Preparer(tc, policy)


def fits(preparer: Preparer, budget: Budget, model, n_tokens: int, n_masked: int, gen=None,
         batch: int = 1, world: int = 1):
    """(True, rank 0's Prepared) if every rank's share of the probe step fits (admission.fit,
    as run-time admission on each rank), else (False, the MemoryBudgetError). Ranks with equal
    rows plan alike: the first (largest share) and the last rank cover both row counts."""
    first = None
    for rank in sorted({0, world - 1}):
        step = probe_step(model, n_tokens, max(1, n_masked), gen, batch=batch, world=world, rank=rank)
        try:
            prepared = fit(preparer, budget, step)
        except MemoryBudgetError as e:
            return False, e
        first = first or prepared
    return True, first


def capacity_report(model, budget, prompt_ratio: float = 0.5, planner: str = "greedy-size",
                    context_bytes=None, ratios=(1.0, 0.1), max_chunks: int = 4096,
                    target: str = "cuda", phases=None, world: int = 1) -> dict:
    """L_max at a budget (per GPU): the longest N (a multiple of 1024) whose capacity probe (one
    step at each mask ratio of the output canvas) fits, with lazy chunking, on every one of
    `world` sequence-parallel ranks. CPU-only: templates are recorded on meta tensors. The test
    is admission.fit on the engine's Preparer: with the same context bytes, target device and
    dtype, run-time admission admits exactly this L_max and refuses L_max + 1024."""
    t0 = time.perf_counter()
    budget_bytes = parse_bytes(budget)
    context = parse_bytes(context_bytes) if context_bytes is not None else H200_CONTEXT_BYTES
    weights = model.weight_bytes()
    fixed = charged_fixed(weights, context)
    bud = Budget(budget_bytes, fixed, weights)
    prep = capacity_preparer(model, bud, planner, target, max_chunks, phases)

    def masked(n, ratio):
        return max(1, round((1 - prompt_ratio) * n * ratio))

    def ok(n):
        return all(fits(prep, bud, model, n, masked(n, r), world=world)[0] for r in ratios)

    floor = floor_bytes_per_token(model.cfg)
    physical = world * max(0, (budget_bytes - fixed)) // (floor + INPUT_BYTES_PER_TOKEN)   # an upper bound
    l_max = longest(ok, max(1024, world), physical + 1024)
    rows = []
    for r in (1.0, 0.5, 0.1):
        good, res = fits(prep, bud, model, max(l_max, 1024), masked(max(l_max, 1024), r), world=world)
        if good and l_max:
            p, tpl = res.plan, res.template
            rows.append({"mask_ratio": r, "masked": masked(l_max, r), "chunks": list(res.chunks.as_tuple()),
                         "plan_bytes": p.total_bytes, "external_bytes": tpl.external_peak(),
                         "predicted_peak_bytes": bud.total(p.total_bytes + tpl.external_peak(), 1, l_max,
                                                           res.step.shard_slots),
                         "peak_phase": tpl.phases[tpl.peak_op()]})
    # which phase stops the next length
    nxt = l_max + 1024
    limiting = None
    for r in ratios:
        good, res = fits(prep, bud, model, nxt, masked(nxt, r), world=world)
        if not good:
            limiting = str(res).split(" phase")[0].replace("the ", "") if "phase" in str(res) else "plan"
            break
    return {"model": model.name, "world": world, "budget_bytes": budget_bytes, "weights_bytes": weights,
            "context_bytes": context, "fixed_bytes": FIXED_BYTES, "prompt_ratio": prompt_ratio,
            "l_max": l_max, "physical_limit": int(physical), "floor_bytes_per_token": floor,
            "limiting_phase": limiting, "steps": rows, "planner": planner,
            "seconds": time.perf_counter() - t0}


def print_capacity(rep: dict) -> str:
    per = f" per GPU x {rep['world']}" if rep.get("world", 1) > 1 else ""
    lines = [f"{rep['model']} at {gib(rep['budget_bytes'])}{per}: L_max = {rep['l_max']:,} tokens "
             f"(physical limit {rep['physical_limit']:,} = (budget - weights - context - workspace) "
             f"/ {rep['floor_bytes_per_token']:,} B per token); next length limited by "
             f"{rep['limiting_phase']}",
             f"{'mask ratio':>10} {'masked':>10} {'chunks a,f,l':>16} {'plan':>11} {'outside':>10} "
             f"{'predicted peak':>15} {'peak phase':>11}"]
    for r in rep["steps"]:
        lines.append(f"{r['mask_ratio']:>10} {r['masked']:>10,} {str(tuple(r['chunks'])):>16} "
                     f"{gib(r['plan_bytes']):>11} {gib(r['external_bytes']):>10} "
                     f"{gib(r['predicted_peak_bytes']):>15} {r['peak_phase']:>11}")
    lines.append(f"({rep['seconds']:.1f} s on this CPU, planner {rep['planner']})")
    return "\n".join(lines)
