"""Held-out accuracy of the bundled tiny models (exact answers), on the planned path.

    python -m bench eval_tiny [--model tiny-llada] [--per-shape 100] [--config engine.yaml --tag sparse]

Exact-answer accuracy on held-out prompts of mosaic/assets/tasks.py (sorting, addition), on the
CPU, with the engine options of --config when given (labelled lossy options are recorded).
Writes tiny_accuracy_<model>[_<tag>].json under --out and prints a table."""

from __future__ import annotations

import time
from collections import defaultdict

from mosaic import MosaicEngine
from mosaic.arg_types import at_least
from mosaic.assets import tasks
from mosaic.config_file import load_engine_config


def add_arguments(ap):
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--per-shape", type=at_least(1), default=100, help="held-out prompts per task shape")
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--config", default=None, help="engine options from a YAML file (e.g. sparse attention)")
    ap.add_argument("--tag", default="", help="suffix of the output file name")


def output(args) -> str:
    return f"tiny_accuracy_{args.model}{'_' + args.tag if args.tag else ''}.json"


def run(args, rec) -> dict:
    opts = {"device": "cpu", "progress": False}
    cfg = load_engine_config(args.config, **opts) if args.config else opts
    engine = MosaicEngine(args.model, cfg)
    prompts = tasks.held_out(args.per_shape)
    by_len = defaultdict(list)
    for p in prompts:
        by_len[len(p)].append(p)
    right, total = defaultdict(int), defaultdict(int)
    wrong = []
    t0 = time.perf_counter()
    for group in by_len.values():
        for i in range(0, len(group), args.batch):
            batch = group[i:i + args.batch]
            out = engine.generate(batch, max_new_tokens=tasks.ANSWER_LEN, steps=tasks.ANSWER_LEN)
            for p, t in zip(batch, out.texts):
                kind = "sort" if p.startswith("sort") else "add"
                total[kind] += 1
                ok = t == tasks.solve(p)
                right[kind] += ok
                if not ok and len(wrong) < 20:
                    wrong.append({"prompt": p, "answer": t, "expected": tasks.solve(p)})
    rec.update(lossy=engine.lossy_options(), accuracy=sum(right.values()) / sum(total.values()),
               by_task={k: right[k] / total[k] for k in total}, count=sum(total.values()),
               seconds=time.perf_counter() - t0, examples_wrong=wrong)
    return rec


def table(rec) -> str:
    lines = [f"{'task':<8} {'exact answers':>14}"]
    lines += [f"{k:<8} {v:>13.1%}" for k, v in sorted(rec["by_task"].items())]
    lines.append(f"{'all':<8} {rec['accuracy']:>13.1%}  ({rec['count']} held-out prompts, {rec['seconds']:.0f} s)")
    return "\n".join(lines)
