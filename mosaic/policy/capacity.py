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
from .admission import longest
from .chunking import PHASES, choose
from .offload import mode_of
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


def fits(tc, model, n_tokens: int, n_masked: int, limit: int, max_chunks: int = 4096,
         gen=None, batch: int = 1, phases=None, world: int = 1, min_attention_rows: int = 0,
         offload=None):
    """(True, chunks) or (False, the MemoryBudgetError) for one probe step (offload: the step's
    graph.streams.Offload, None for resident weights)."""
    step = probe_step(model, n_tokens, max(1, n_masked), gen, batch=batch, world=world).with_(offload=offload)
    try:
        return True, choose(tc, step, limit, max_chunks, PHASES if phases is None else phases,
                            min_attention_rows=min_attention_rows)
    except MemoryBudgetError as e:
        return False, e


def capacity_report(model, budget, prompt_ratio: float = 0.5, planner: str = "greedy-size",
                    context_bytes=None, ratios=(1.0, 0.1), max_chunks: int = 4096,
                    target: str = "cuda", phases=None, world: int = 1, min_attention_rows: int = 0,
                    offload=None) -> dict:
    """L_max at a budget: the longest N whose capacity probe (one step at each mask ratio of the
    output canvas) fits, with lazy chunking (attention chunks of at least min_attention_rows
    query rows when > 0). CPU-only: templates are recorded on meta tensors. offload: a
    graph.streams.Offload (weights in host memory: only the non-layer weights are charged, the
    staging slots are in the plan; with kv, K and V too: the floor is x alone)."""
    t0 = time.perf_counter()
    budget_bytes = parse_bytes(budget)
    context = parse_bytes(context_bytes) if context_bytes is not None else H200_CONTEXT_BYTES
    weights = model.weight_bytes(layers=offload is None)
    fixed = charged_fixed(weights, context)
    bud = Budget(budget_bytes, fixed, weights)
    tc = templates_for(model, planner, target)
    limit = lambda n: bud.activation_limit(1, n)  # noqa: E731  (per GPU)

    def masked(n, ratio):
        return max(1, round((1 - prompt_ratio) * n * ratio))

    def ok(n):
        return all(fits(tc, model, n, masked(n, r), limit(n), max_chunks, phases=phases,
                        world=world, min_attention_rows=min_attention_rows, offload=offload)[0] for r in ratios)

    floor = floor_bytes_per_token(model.cfg)
    if offload is not None and offload.kv:   # K and V live in host memory: x is the floor
        floor = model.dtype.itemsize * model.cfg.hidden
    physical = world * max(0, (budget_bytes - fixed)) // (floor + INPUT_BYTES_PER_TOKEN)
    l_max = longest(ok, 1024, physical + 1024)
    rows = []
    for r in (1.0, 0.5, 0.1):
        good, res = fits(tc, model, max(l_max, 1024), masked(max(l_max, 1024), r),
                         limit(max(l_max, 1024)), max_chunks, phases=phases, world=world,
                         min_attention_rows=min_attention_rows, offload=offload)
        if good:
            probe = probe_step(model, l_max, masked(l_max, r), world=world).with_(offload=offload)
            tpl, _, _ = tc.template(probe, res)
            p = tc.plan(tpl, tc.key(probe, res))
            peak = bud.total(p.total_bytes + tpl.external_peak(), 1, l_max)
            rows.append({"mask_ratio": r, "masked": masked(l_max, r), "chunks": list(res.as_tuple()),
                         "plan_bytes": p.total_bytes, "external_bytes": tpl.external_peak(),
                         "predicted_peak_bytes": peak, "host_bytes": tpl.host_bytes,
                         "peak_phase": tpl.phases[tpl.peak_op()]})
    # which phase stops the next length
    nxt = l_max + 1024
    limiting = None
    for r in ratios:
        good, res = fits(tc, model, nxt, masked(nxt, r), limit(nxt), max_chunks, phases=phases,
                         world=world, min_attention_rows=min_attention_rows, offload=offload)
        if not good:
            limiting = str(res).split(" phase")[0].replace("the ", "") if "phase" in str(res) else "plan"
            break
    return {"model": model.name, "world": world, "budget_bytes": budget_bytes, "weights_bytes": weights,
            "context_bytes": context, "fixed_bytes": FIXED_BYTES, "prompt_ratio": prompt_ratio,
            "l_max": l_max, "physical_limit": int(physical), "floor_bytes_per_token": floor,
            "limiting_phase": limiting, "steps": rows, "planner": planner,
            "min_attention_rows": min_attention_rows, "offload": mode_of(offload),
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
