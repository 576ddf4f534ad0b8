"""The README's L_max table from `mosaic plan`'s own code path (CPU).

    python -m bench capacity_table [--out DIR] [--budgets 24GiB 40GiB 80GiB]
    python -m bench capacity_table --models llada-8b --budgets 40GiB --kv-tiers none device host

Each row is `mosaic plan --model M --budget B --json` (policy/capacity.capacity_report, the
H200's measured context and workspace from memory/accounting.py), so the table and the command
agree to the token by construction; tests/memory/test_accounting.py checks that run-time
admission accepts L_max and refuses L_max + 1024 with the same charges. --kv-tiers adds rows
with a Fast-dLLM block cache whose K/V live on the device or the host (`mosaic plan --kv-tier`).
Writes capacity_table.json and .md under --out (capacity_kv_tiers.json and .md with
--kv-tiers); prints the markdown."""

from __future__ import annotations

import sys

from mosaic import load
from mosaic.policy.capacity import capacity_report

MODELS = ("llada-8b", "dream-7b", "llada-moe-7b")
GiB = 2**30


def rows(budgets, models=MODELS, tiers=("none",)) -> list[dict]:
    out = []
    for name in models:
        model = load(name, device="meta")
        for b, tier in ((b, t) for b in budgets for t in tiers):
            kv = None if tier == "none" else tier
            rep = capacity_report(model, b, kv_tier=kv)
            first = rep["steps"][0] if rep["steps"] else {}
            out.append({"model": name, "budget": b, "kv_tier": kv, "budget_bytes": rep["budget_bytes"],
                        "l_max": rep["l_max"],
                        "physical_limit": rep["physical_limit"], "limiting_phase": rep["limiting_phase"],
                        "chunks_ratio_1": first.get("chunks"),
                        "predicted_peak_bytes": first.get("predicted_peak_bytes"),
                        "context_bytes": rep["context_bytes"], "workspace_bytes": rep["workspace_bytes"],
                        "late_load_bytes": rep["late_load_bytes"], "rounding_bytes": rep["rounding_bytes"],
                        "command": f"mosaic plan --model {name} --budget {b}" + (f" --kv-tier {kv}" if kv else ""),
                        "seconds": rep["seconds"]})
            print(f"{name} @ {b} kv {kv}: {rep['l_max']:,} ({rep['seconds']:.1f} s)", file=sys.stderr, flush=True)
    return out


def markdown(rs: list[dict]) -> str:
    tiers = any(r.get("kv_tier") for r in rs)
    lines = ["| model | budget | " + ("K/V cache | " if tiers else "") +
             "L_max (`mosaic plan`) | physical limit | L_max / physical | chunks at mask ratio 1 "
             "(attn, ffn, logits) | predicted peak |",
             "|---|---|---|---|---|---|---|" + ("---|" if tiers else "")]
    for r in rs:
        chunks = tuple(r["chunks_ratio_1"]) if r["chunks_ratio_1"] else "—"
        peak = f"{r['predicted_peak_bytes'] / GiB:.2f} GiB" if r["predicted_peak_bytes"] else "—"
        kv = f"{r.get('kv_tier') or 'none'} | " if tiers else ""
        lines.append(f"| {r['model']} | {r['budget']} | {kv}{r['l_max']:,} | {r['physical_limit']:,} | "
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
    ap.add_argument("--kv-tiers", nargs="+", choices=("none", "device", "host"), default=["none"],
                    help="rows with a block cache's K/V on the device or the host too")


def output(args) -> str:
    return "capacity_table.json" if args.kv_tiers == ["none"] else "capacity_kv_tiers.json"


def run(args, rec) -> dict:
    rec["rows"] = rows(args.budgets, args.models, args.kv_tiers)
    rec.save()
    rec.path.with_suffix(".md").write_text(markdown(rec["rows"]) + "\n")
    return rec


def table(rec) -> str:
    return markdown(rec["rows"])
