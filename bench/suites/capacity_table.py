"""The README's L_max table from `mosaic plan`'s own code path (CPU).

    python -m bench capacity_table [--out DIR] [--budgets 24GiB 40GiB 80GiB]

Each row is `mosaic plan --model M --budget B --json` (policy/capacity.capacity_report, the
H200's measured context and workspace from memory/accounting.py), so the table and the command
agree to the token by construction; tests/memory/test_accounting.py checks that run-time
admission accepts L_max and refuses L_max + 1024 with the same charges. Writes
capacity_table.json and capacity_table.md under --out; prints the markdown."""

from __future__ import annotations

import sys

from mosaic import load
from mosaic.policy.capacity import capacity_report

MODELS = ("llada-8b", "dream-7b", "llada-moe-7b")
GiB = 2**30


def rows(budgets, models=MODELS) -> list[dict]:
    out = []
    for name in models:
        model = load(name, device="meta")
        for b in budgets:
            rep = capacity_report(model, b)
            first = rep["steps"][0] if rep["steps"] else {}
            out.append({"model": name, "budget": b, "budget_bytes": rep["budget_bytes"], "l_max": rep["l_max"],
                        "physical_limit": rep["physical_limit"], "limiting_phase": rep["limiting_phase"],
                        "chunks_ratio_1": first.get("chunks"),
                        "predicted_peak_bytes": first.get("predicted_peak_bytes"),
                        "context_bytes": rep["context_bytes"], "workspace_bytes": rep["workspace_bytes"],
                        "late_load_bytes": rep["late_load_bytes"], "rounding_bytes": rep["rounding_bytes"],
                        "command": f"mosaic plan --model {name} --budget {b}", "seconds": rep["seconds"]})
            print(f"{name} @ {b}: {rep['l_max']:,} ({rep['seconds']:.1f} s)", file=sys.stderr, flush=True)
    return out


def markdown(rs: list[dict]) -> str:
    lines = ["| model | budget | L_max (`mosaic plan`) | physical limit | L_max / physical | chunks at mask ratio 1 "
             "(attn, ffn, logits) | predicted peak |",
             "|---|---|---|---|---|---|---|"]
    for r in rs:
        chunks = tuple(r["chunks_ratio_1"]) if r["chunks_ratio_1"] else "—"
        peak = f"{r['predicted_peak_bytes'] / GiB:.2f} GiB" if r["predicted_peak_bytes"] else "—"
        lines.append(f"| {r['model']} | {r['budget']} | {r['l_max']:,} | {r['physical_limit']:,} | "
                     f"{r['l_max'] / max(1, r['physical_limit']):.4f} | {chunks} | {peak} |")
    r0 = rs[0]
    lines.append("")
    lines.append(f"Charged besides the weights: context {r0['context_bytes'] / GiB:.2f} GiB, workspace "
                 f"{r0['workspace_bytes'] / 2**20:.0f} MiB, late kernel loads {r0['late_load_bytes'] / 2**20:.0f} MiB, "
                 f"allocator rounding {r0['rounding_bytes'] / 2**20:.2f} MiB (memory/accounting.py); "
                 "regenerate with `python -m bench capacity_table`.")
    return "\n".join(lines)


def add_arguments(ap):
    ap.add_argument("--budgets", nargs="+", default=["24GiB", "40GiB", "80GiB"])
    ap.add_argument("--models", nargs="+", default=list(MODELS))


def run(args, rec) -> dict:
    rec["rows"] = rows(args.budgets, args.models)
    rec.save()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "capacity_table.md").write_text(markdown(rec["rows"]) + "\n")
    return rec


def table(rec) -> str:
    return markdown(rec["rows"])
