"""Quality vs speed of Fast-dLLM decoding on the bundled models (CPU is enough).

    python -m bench eval_fast [--per-shape 25] [--models tiny-llada tiny-dream] [--out DIR]

For each model: held-out accuracy (exact answers, mosaic/assets/tasks.py) of the exact reference
sampler and of each accelerated setting (cache none/prefix/dual x commit rule), with the number
of function evaluations (forwards) per generated token of each sequence (what it takes alone, as
Fast-dLLM reports at batch 1; Generation.stats['nfe_per_row']) and the CPU wall time. Writes
fast_quality.json and fast_quality.png (accuracy vs NFE per token) under --out, prints a table."""

from __future__ import annotations

import json
import time
from collections import defaultdict

from mosaic import MosaicEngine
from mosaic.assets import tasks

N = tasks.ANSWER_LEN   # 8 answer tokens

EXACT = {"tiny-llada": [("exact", dict(steps=N)), ("exact, block 4", dict(steps=N, block_length=4))],
         "tiny-dream": [("exact", dict(steps=N))]}
# every cached setting uses two blocks of 4 (Fast-dLLM's evaluations use blocks of 32 of 256)
LLADA_FAST = [("prefix, counts", dict(cache="prefix", steps=N, block_length=4)),
              ("dual, counts", dict(cache="dual", steps=N, block_length=4))] + \
    [(f"{c}, threshold {t}", dict(cache=c, threshold=t, steps=2, block_length=4))
     for c in ("none", "prefix", "dual") for t in (0.5, 0.7, 0.9, 0.95)] + \
    [(f"dual, factor {f}", dict(cache="dual", factor=f, steps=2, block_length=4)) for f in (0.5, 1.0, 2.0)]
DREAM_FAST = [("prefix, entropy schedule", dict(cache="prefix", alg="entropy", steps=N, block_length=4)),
              ("dual, entropy schedule", dict(cache="dual", alg="entropy", steps=N, block_length=4))] + \
    [(f"none, threshold {t}", dict(threshold=t, steps=2)) for t in (0.5, 0.9)] + \
    [(f"{c}, threshold {t}", dict(cache=c, threshold=t, steps=2, block_length=4))
     for c in ("prefix", "dual") for t in (0.5, 0.7, 0.9, 0.95)] + \
    [(f"dual, factor {f}", dict(cache="dual", factor=f, steps=2, block_length=4)) for f in (0.5, 1.0, 2.0)]


def evaluate(engine, prompts, opts, batch):
    right, total, nfe, toks = 0, 0, 0, 0
    by_len = defaultdict(list)
    for p in prompts:
        by_len[len(p)].append(p)
    t0 = time.perf_counter()
    for group in by_len.values():   # one prompt length per batch: no padding, as trained
        for i in range(0, len(group), batch):
            chunk = group[i:i + batch]
            out = engine.generate(chunk, max_new_tokens=N, **opts)
            right += sum(t == tasks.solve(p) for p, t in zip(chunk, out.texts))
            total += len(chunk)
            nfe += sum(out.stats["nfe_per_row"]) if out.stats else out.steps * len(chunk)
            toks += N * len(chunk)
    return {"accuracy": right / total, "count": total, "nfe_per_token": nfe / toks,
            "seconds": time.perf_counter() - t0}


def add_arguments(ap):
    ap.add_argument("--per-shape", type=int, default=25)
    ap.add_argument("--batch", type=int, default=25)
    ap.add_argument("--models", nargs="+", default=["tiny-llada", "tiny-dream"])
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from --out's fast_quality.json")


def output(args) -> str:
    return "fast_quality.json"


def run(args, rec) -> dict:
    if args.plot_only:
        rec.update(json.loads((args.out / "fast_quality.json").read_text()))
        plot(rec, args.out / "fast_quality.png")
        return rec
    prompts = tasks.held_out(args.per_shape)
    rec.update(answer_tokens=N, models={})
    for name in args.models:
        engine = MosaicEngine(name, {"device": "cpu", "progress": False})
        rows = rec["models"][name] = []
        fast = LLADA_FAST if engine.model.cfg.family != "dream" else DREAM_FAST
        for label, opts in EXACT[name] + fast:
            try:
                r = {"setting": label, "options": opts, **evaluate(engine, prompts, opts, args.batch)}
            except Exception as e:  # noqa: BLE001  (a bench: record and go on)
                r = {"setting": label, "options": opts, "error": f"{type(e).__name__}: {e}"}
            rows.append(r)
            rec.save()
            print(f"{name:<11} {label:<28} " + (f"acc {r['accuracy']:6.1%}  NFE/token {r['nfe_per_token']:.3f}  "
                                                f"{r['seconds']:6.1f} s" if "error" not in r else r["error"]),
                  flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(rec, args.out / "fast_quality.png")
    return rec


def table(rec) -> str:
    lines = [f"{'model':<11} {'setting':<28} {'accuracy':>8} {'NFE/token':>9}"]
    for name, rows in rec["models"].items():
        lines += [f"{name:<11} {r['setting']:<28} " + (f"{r['accuracy']:>8.1%} {r['nfe_per_token']:>9.3f}"
                  if "error" not in r else r["error"][:60]) for r in rows]
    return "\n".join(lines)


def plot(rec, path):
    """Accuracy vs forwards per token: colour = cache, marker = commit rule, label = its value."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colours = {"exact": "black", "none": "tab:green", "prefix": "tab:blue", "dual": "tab:orange"}
    markers = {"exact": "*", "threshold": "o", "factor": "^", "schedule": "s"}
    fig, axes = plt.subplots(1, len(rec["models"]), figsize=(6 * len(rec["models"]), 4.5), squeeze=False)
    for ax, (name, rows) in zip(axes[0], rec["models"].items()):
        seen = set()
        for r in rows:
            if "error" in r:
                continue
            o = r["options"]
            cache = "exact" if r["setting"].startswith("exact") else o.get("cache", "none")
            rule = "exact" if cache == "exact" else "threshold" if "threshold" in o else \
                "factor" if "factor" in o else "schedule"
            jitter = {"none": -0.004, "prefix": 0.0, "dual": 0.004, "exact": 0.0}[cache]
            xy = (r["nfe_per_token"] + jitter, 100 * r["accuracy"])
            label = f"{cache}, {rule}" if cache != "exact" else "exact sampler"
            ax.scatter(*xy, marker=markers[rule], color=colours[cache], s=120 if cache == "exact" else 40,
                       label=label if label not in seen else None, alpha=0.8)
            seen.add(label)
            value = o.get("threshold", o.get("factor"))
            if value is not None:
                ax.annotate(str(value), xy, fontsize=6, xytext=(3, 2), textcoords="offset points")
        ax.set_xlabel("forwards per generated token, per sequence (lower is faster)")
        ax.set_ylabel("held-out exact answers (%)")
        ax.set_title(f"{name}: Fast-dLLM settings vs the exact sampler")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center")
    fig.tight_layout()
    fig.savefig(path, dpi=130)

