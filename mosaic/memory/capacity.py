"""Planning without running: templates of a model (meta weights) for a key, and their plans."""

from __future__ import annotations

import torch

from ..config import GenerationConfig, parse_bytes
from ..errors import MemoryBudgetError
from ..models.layers import Chunks
from .planner import PLANNERS, align, plan


def probe_step(model, n_tokens: int, n_masked: int, gen: GenerationConfig | None = None,
               batch: int = 1, world: int = 1):
    """A Step of n_tokens per sequence with n_masked masked slots, on meta tensors (no memory).
    With world > 1: rank 0's share under sequence parallelism (the largest slice)."""
    from ..engine.reducers import DreamReducer, LLaDAReducer
    from ..engine.runners import make_step
    gen = gen or GenerationConfig()
    meta = torch.device("meta")
    ids = torch.empty(batch, n_tokens, dtype=torch.long, device=meta)
    step = make_step(model, ids, None)
    if world > 1:
        from ..engine.parallel import Shard
        step.shard = Shard.of(n_tokens, 0, world)
        n_masked = -(-n_masked // world)
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


def floor_bytes_per_token(cfg, itemsize: int = 2) -> int:
    """The x + K + V floor: the residual stream plus one layer's keys and values."""
    return itemsize * (cfg.hidden + 2 * cfg.kv_dim)


def fits(runner, model, n_tokens: int, n_masked: int, limit: int, max_chunks: int = 4096,
         gen=None, batch: int = 1, phases=None, world: int = 1):
    """(True, chunks) or (False, the MemoryBudgetError) for one probe step."""
    from .chunking import PHASES, choose
    step = probe_step(model, n_tokens, max(1, n_masked), gen, batch=batch, world=world)
    try:
        return True, choose(runner, step, limit, max_chunks, PHASES if phases is None else phases)
    except MemoryBudgetError as e:
        return False, e


def longest(ok, lo: int, hi: int, unit: int = 1024) -> int:
    """Largest multiple of `unit` in [lo, hi] with ok(n) true (ok is monotone); 0 if none."""
    lo_u, hi_u = max(1, lo // unit), max(1, hi // unit)
    if not ok(lo_u * unit):
        return 0
    while lo_u < hi_u:
        mid = (lo_u + hi_u + 1) // 2
        if ok(mid * unit):
            lo_u = mid
        else:
            hi_u = mid - 1
    return lo_u * unit


def capacity_report(model, budget, prompt_ratio: float = 0.5, planner: str = "greedy-size",
                    context_bytes=None, ratios=(1.0, 0.1), max_chunks: int = 4096,
                    target: str = "cuda", phases=None, world: int = 1) -> dict:
    """L_max at a budget: the longest N whose capacity probe (one step at each mask ratio of the
    output canvas) fits, with lazy chunking. CPU-only: templates are recorded on meta tensors."""
    import time

    from .budget import FIXED_BYTES, H200_CONTEXT_BYTES, INPUT_BYTES_PER_TOKEN, charged_fixed, input_bytes
    t0 = time.perf_counter()
    budget_bytes = parse_bytes(budget)
    context = parse_bytes(context_bytes) if context_bytes is not None else H200_CONTEXT_BYTES
    weights = model.weight_bytes()
    fixed = charged_fixed(weights, context)
    runner = runner_for(model, planner, target)
    limit = lambda n: budget_bytes - fixed - input_bytes(1, n)  # noqa: E731  (per GPU)

    def masked(n, ratio):
        return max(1, round((1 - prompt_ratio) * n * ratio))

    def ok(n):
        return all(fits(runner, model, n, masked(n, r), limit(n), max_chunks, phases=phases,
                        world=world)[0] for r in ratios)

    floor = floor_bytes_per_token(model.cfg)
    physical = world * max(0, (budget_bytes - fixed)) // (floor + INPUT_BYTES_PER_TOKEN)
    l_max = longest(ok, 1024, physical + 1024)
    rows = []
    for r in (1.0, 0.5, 0.1):
        good, res = fits(runner, model, max(l_max, 1024), masked(max(l_max, 1024), r),
                         limit(max(l_max, 1024)), max_chunks, phases=phases, world=world)
        if good:
            probe = probe_step(model, l_max, masked(l_max, r), world=world)
            tpl, _, _ = runner.template(probe, res)
            p = runner.plan(tpl, runner.key(probe, res))
            peak = p.total_bytes + tpl.external_peak() + fixed + input_bytes(1, l_max)
            rows.append({"mask_ratio": r, "masked": masked(l_max, r), "chunks": list(res.as_tuple()),
                         "plan_bytes": p.total_bytes, "external_bytes": tpl.external_peak(),
                         "predicted_peak_bytes": peak,
                         "peak_phase": tpl.phases[tpl.peak_op()]})
    # which phase stops the next length
    nxt = l_max + 1024
    limiting = None
    for r in ratios:
        good, res = fits(runner, model, nxt, masked(nxt, r), limit(nxt), max_chunks, phases=phases,
                         world=world)
        if not good:
            limiting = str(res).split(" phase")[0].replace("the ", "") if "phase" in str(res) else "plan"
            break
    return {"model": model.name, "world": world, "budget_bytes": budget_bytes, "weights_bytes": weights,
            "context_bytes": context, "fixed_bytes": FIXED_BYTES, "prompt_ratio": prompt_ratio,
            "l_max": l_max, "physical_limit": int(physical), "floor_bytes_per_token": floor,
            "limiting_phase": limiting, "steps": rows, "planner": planner,
            "seconds": time.perf_counter() - t0}


def print_capacity(rep: dict) -> str:
    from ..errors import gib
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


def longest_fitting(engine, batch: int, length: int, gen) -> int:
    """The longest total length (same masked share as this request) whose first step fits."""
    from .budget import activation_limit, first_step
    runner = engine.planned
    m0 = first_step(engine, batch, length, gen).rows.shape[0]

    def ok(n):
        step = first_step(engine, batch, n, gen)
        step.rows = torch.empty(max(1, round(m0 * n / length)), dtype=torch.long, device="meta")
        if step.rows_uncond is not None:
            step.rows_uncond = step.rows
        from .chunking import choose
        try:
            choose(runner, step, activation_limit(engine, step), engine.config.max_chunks)
            return True
        except MemoryBudgetError:
            return False
    return longest(ok, 1, length, unit=1)
