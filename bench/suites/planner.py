"""Planner quality and speed on the presets' step templates (CPU, meta tensors).

    python -m bench planner [--out DIR]      # N in {8k, 128k, 1M}, M in {N/2, N/20}

For each template: every planner's total / LOAD and its time; then the engine's per-step cost
with a cached template (template + plan lookup, chunk decision) over a falling-M decode, and the
cost of the lazy chunk search at 40 GiB. Writes planner_table.json under --out."""

from __future__ import annotations

import statistics
import time

from mosaic import load
from mosaic.memory.planner import PLANNERS
from mosaic.policy.capacity import plan_report, templates_for
from mosaic.policy.chunking import LazyChunker
from mosaic.policy.prepare import Preparer
from mosaic.policy.probe import probe_step

MODELS = ["llada-8b", "dream-7b", "llada-moe-7b"]


def per_step_cost(model, n, steps=16, budget_bytes=None):
    """Median / max ms per step of choosing chunks + fetching the template and plan, as the
    engine does while M falls over a request (the first step records and plans)."""
    from mosaic.memory.accounting import FIXED_BYTES, H200_CONTEXT_BYTES, input_bytes
    limit = None
    if budget_bytes:
        fixed = model.weight_bytes() + H200_CONTEXT_BYTES + FIXED_BYTES
        limit = budget_bytes - fixed - input_bytes(1, n)
    runner = Preparer(templates_for(model), LazyChunker(lambda s: limit))
    times = []
    for i in range(steps):
        m = max(1, (n // 2) * (steps - i) // steps)
        step = probe_step(model, n, m)
        t0 = time.perf_counter()
        runner.prepare(step)
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "max_ms": max(times), "first_ms": times[0],
            "chunks": list(runner.history[0].chunks)}


def add_arguments(ap):
    ap.add_argument("--tokens", type=int, nargs="*", default=[8192, 131072, 1048576])
    ap.add_argument("--models", nargs="*", default=MODELS)


def output(args) -> str:
    return "planner_table.json"


def run(args, rec) -> dict:
    rows, steps = [], []
    rec.update(planners=PLANNERS[:4], templates=rows, per_step=steps)
    for name in args.models:
        model = load(name, device="meta")
        for n in args.tokens:
            for m in (n // 2, n // 20):
                rows.append(plan_report(model, n, m, PLANNERS[:4]))
            steps.append({"model": name, "tokens": n, "cached": per_step_cost(model, n),
                          "lazy_40GiB": per_step_cost(model, n, budget_bytes=40 * 2**30)})
            rec.save()
    return rec


def table(rec) -> str:
    planners = rec["planners"]
    lines = [f"{'model':<13} {'N':>9} {'M':>8} {'bufs':>5} " +
             " ".join(f"{p + ' %>LOAD':>17} {'ms':>6}" for p in planners)]
    for r in rec["templates"]:
        cells = " ".join(f"{100 * p['over_load']:>17.2f} {p['plan_ms']:>6.2f}" for p in r["planners"])
        lines.append(f"{r['model']:<13} {r['tokens']:>9,} {r['masked']:>8,} {r['num_buffers']:>5} {cells}")
    lines.append(f"\n{'model':<13} {'N':>9} {'cached ms/step (median, max)':>30} "
                 f"{'lazy 40GiB (median, max, chunks)':>40}")
    for s in rec["per_step"]:
        c, lz = s["cached"], s["lazy_40GiB"]
        lines.append(f"{s['model']:<13} {s['tokens']:>9,} {c['median_ms']:>14.3f} {c['max_ms']:>14.2f} "
                     f"{lz['median_ms']:>14.3f} {lz['max_ms']:>10.1f} {str(tuple(lz['chunks'])):>15}")
    return "\n".join(lines)
