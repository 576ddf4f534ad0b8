"""The L_max tables and plots of docs/RESULTS.md from the committed JSON (CPU).

    python -m bench report --out bench/results    # report.md, lmax.json, lmax.png, step_memory.png

Reads the committed GPU records under bench/results/gpu/. L_max of Mosaic and its planner
ablations comes from the capacity planner (CPU) charged the CUDA context measured on the H200
(part_c.json); the baselines' L_max are measured on the H200 by probing steps around each budget
(the baselines suite: baselines_native.json, part_d_llada.json). Where a baseline was not
probed, a linear fit of its peaks at 4k/8k/16k (part_b.json) is shown as ~N."""

from __future__ import annotations

import json

from bench.lib.record import RESULTS as RES
from mosaic import load
from mosaic.policy.capacity import capacity_report

GPU = RES / "gpu"
GiB = 2**30
MODELS = ["llada-8b", "dream-7b", "llada-moe-7b"]
BUDGETS = [24, 40, 80]
VARIANTS = {"Mosaic": None, "planner+arena, no chunking": (), "+ logits/FFN chunking": ("ffn", "logits")}


def load_json(name):
    return json.loads((GPU / name).read_text())["sections"]


def fit(lengths, peaks, budget):
    slope = (peaks[-1] - peaks[-2]) / (lengths[-1] - lengths[-2])
    base = peaks[-1] - slope * lengths[-1]
    return max(0, int((budget - base) / slope) // 1024 * 1024)


BASELINES = ["mask_only_eager", "native_model", "native_float64", "native_expandable", "native_compiled"]


def measured_baselines() -> dict:
    """model -> baseline -> {budget GiB: L_max} from the probing runs (later files win)."""
    out = {}
    for name in ("baselines_native.json", "part_d_llada.json"):
        rec = json.loads((GPU / name).read_text())
        found = rec.get("baselines") or rec.get("sections", {}).get("baselines", rec)   # new or old records
        for model, r in found.items():
            for variant, v in r["variants"].items():
                out.setdefault(model, {})[variant] = {int(b): n for b, n in v["l_max"].items()}
    return out


def lmax_table():
    b, c = load_json("part_b.json"), load_json("part_c.json")
    contexts = {"llada-8b": c["capacity_llada"]["report"]["context_bytes"],
                "dream-7b": c["capacity_dream"]["report"]["context_bytes"],
                "llada-moe-7b": c["capacity_moe"]["report"]["context_bytes"]}
    fits = {r["model"]: r for r in b["native_peaks"]}
    probed = measured_baselines()
    rows = []
    for name in MODELS:
        meta = load(name, device="meta")
        for gb in BUDGETS:
            row = {"model": name, "budget_gib": gb, "fitted": []}
            for label, phases in VARIANTS.items():
                rep = capacity_report(meta, f"{gb}GiB", context_bytes=contexts[name], phases=phases)
                row[label] = rep["l_max"]
                row["physical"] = rep["physical_limit"]
            for key in BASELINES:
                if key in probed.get(name, {}):
                    row[key] = probed[name][key][gb]
                elif key in fits[name]:
                    row[key] = fit(fits[name]["lengths"], fits[name][key], gb * GiB)
                    row["fitted"].append(key)
            rows.append(row)
    return rows


def verified():
    c, final = load_json("part_c.json"), load_json("part_c_llada_final.json")
    out = []
    for key, sec, commit in (("llada-8b", final["capacity_llada"], "f38a008"),
                             ("llada-8b", c["capacity_llada"], "7bff791"),
                             ("llada-moe-7b", c["capacity_moe"], "7bff791"),
                             ("dream-7b", c["capacity_dream"], "7bff791")):
        for r in sec["runs"]:
            out.append({"model": key, "budget": sec["budget"], "tokens": sec["report"]["l_max"],
                        "commit": commit, **r})
    return out


def plot_lmax(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5), sharey=True)
    series = [("physical", "physical limit (x+K+V floor)", "--"), ("Mosaic", "Mosaic", "o-"),
              ("+ logits/FFN chunking", "Mosaic, attention unchunked", "s-"),
              ("planner+arena, no chunking", "planner + arena, no chunking", "^-"),
              ("mask_only_eager", "mask-only logits, PyTorch allocator", "v-"),
              ("native_expandable", "native + expandable_segments", "d-"),
              ("native_compiled", "native + torch.compile", "*-"),
              ("native_model", "native, bf16 confidences", "x-"),
              ("native_float64", "native, float64 confidences", "+-")]
    colors = dict(zip([k for k, _, _ in series], plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    colors["physical"] = "k"
    for ax, name in zip(axes, MODELS):
        sub = [r for r in rows if r["model"] == name]
        for key, label, style in series:  # one colour per series in every panel
            if key in sub[0]:
                ax.plot([r["budget_gib"] for r in sub], [max(r[key], 1) for r in sub], style,
                        color=colors[key], label=label)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("budget (GiB)")
        ax.set_xticks(BUDGETS)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("L_max (tokens)")
    handles = {h.get_label(): h for ax in axes for h in ax.get_lines()}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=4, fontsize=8)
    fig.suptitle("Longest request that fits on an H200 (baselines probed; Mosaic planned, verified at 40/24 GiB)")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)


def plot_step_memory(path, n=32768):
    """One LLaDA-8B step at N=32k, M=N/2: Mosaic's planned activation bytes per op vs the native
    forward's live tensors per op plus the published sampler's full logits and softmax."""
    import torch

    from mosaic.graph.record import RecordCtx
    from mosaic.models.layers import step_program
    from mosaic.models.step import Step
    from mosaic.policy.capacity import templates_for
    from mosaic.policy.chunking import base_chunks
    from mosaic.policy.probe import probe_step
    from mosaic.policy.timeline import planned_series, plot
    model = load("llada-8b", device="meta")
    runner = templates_for(model)
    step = probe_step(model, n, n // 2)
    tpl, _, _ = runner.template(step, base_chunks(step))
    ids = torch.empty(1, n, dtype=torch.long, device="meta")
    rec = RecordCtx(torch.device("cuda"), torch.bfloat16)
    step_program(rec, model, Step(ids, torch.empty(1, n, dtype=torch.long, device="meta")))
    native = planned_series(rec.template())
    logits = n * model.cfg.vocab * 2
    native += [native[-1] + logits] * max(1, len(native) // 40)  # softmax beside the logits
    plot({"native: forward (recorded) + sampler softmax": native, "Mosaic (planned)": planned_series(tpl)},
         path, f"LLaDA-8B, one step at N = {n:,}, M = {n // 2:,}: activation memory")


def planner_md() -> list[str]:
    rec = json.loads((RES / "planner_table.json").read_text())
    names = [p["planner"] for p in rec["templates"][0]["planners"]]
    out = ["| model | N | M | buffers | " + " | ".join(f"{n}: % over LOAD, ms" for n in names) + " |",
           "|---|---|---|---|" + "---|" * len(names)]
    for t in rec["templates"]:
        cells = " | ".join(f"{100 * p['over_load']:.2f}%, {p['plan_ms']:.1f}" for p in t["planners"])
        out.append(f"| {t['model']} | {t['tokens']:,} | {t['masked']:,} | {t['num_buffers']} | {cells} |")
    return out


def add_arguments(ap):
    pass


def output(args) -> str:
    return "lmax.json"


def run(args, rec) -> dict:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    rows = lmax_table()
    rec.update(rows=rows, verified=verified())
    plot_lmax(rows, out / "lmax.png")
    plot_step_memory(out / "step_memory.png")
    md = ["| model | budget | Mosaic | attention unchunked | no chunking | mask-only, eager | native bf16 | "
          "native f64 | native + expandable | native + compile | physical limit | Mosaic / native bf16 |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(r, key):
        if key not in r:
            return "—"
        return ("~" if key in r["fitted"] else "") + format(r[key], ",")
    for r in rows:
        md.append(f"| {r['model']} | {r['budget_gib']} GiB | {r['Mosaic']:,} | {r['+ logits/FFN chunking']:,} | "
                  f"{r['planner+arena, no chunking']:,} | "
                  + " | ".join(cell(r, k) for k in BASELINES)
                  + f" | {r['physical']:,} | {r['Mosaic'] / max(r.get('native_model', 1), 1):.1f}x |")
    md.append("")
    md.append("| verified on the H200 | budget | N | mask ratio | chunks (attn, ffn, logits) | predicted | "
              "measured | under budget |")
    md.append("|---|---|---|---|---|---|---|---|")
    for v in verified():
        md.append(f"| {v['model']} ({v['commit']}) | {v['budget']} | {v['tokens']:,} | {v['mask_ratio']} | "
                  f"{tuple(v['chunks'])} | "
                  f"{v['predicted_bytes'] / GiB:.2f} GiB | {v['measured_bytes'] / GiB:.2f} GiB | "
                  f"{'yes' if v['within_budget'] else 'NO'} |")
    md += [""] + planner_md()
    natives = {r["model"]: r for r in load_json("part_b.json")["native_peaks"]}
    md.append("")
    for name in ("llada-8b", "dream-7b"):
        r = natives[name]
        slope = (r["native_model"][-1] - r["native_model"][-2]) / (r["lengths"][-1] - r["lengths"][-2])
        at = r["native_model"][-1] + slope * (32768 - r["lengths"][-1])
        md.append(f"native bf16 device peak of {name} at 32,768 tokens (linear fit): {at / GiB:.2f} GiB")
    (out / "report.md").write_text("\n".join(md) + "\n")
    rec["markdown"] = "\n".join(md)
    return rec


def table(rec) -> str:
    return rec["markdown"]
