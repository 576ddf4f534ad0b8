"""Held-out accuracy of the bundled tiny models (exact answers), on the planned path.

    python bench/eval_tiny.py [--model tiny-llada] [--per-shape 100]

Writes bench/results/tiny_accuracy_<model>.json and prints a table."""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from common import record_header

from mosaic import MosaicEngine
from mosaic.assets import tasks
from mosaic.config_file import load_engine_config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--per-shape", type=int, default=100)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--config", default=None, help="engine options from a YAML file (e.g. sparse attention)")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    args = ap.parse_args()
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
    seconds = time.perf_counter() - t0
    acc = {k: right[k] / total[k] for k in total}
    overall = sum(right.values()) / sum(total.values())
    rec = {**record_header({"model": args.model, "per_shape": args.per_shape, "config": args.config}),
           "lossy": engine.lossy_options(),
           "accuracy": overall, "by_task": acc, "count": sum(total.values()),
           "seconds": seconds, "examples_wrong": wrong}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"tiny_accuracy_{args.model}{'_' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(rec, indent=2) + "\n")
    print(f"{'task':<8} {'exact answers':>14}")
    for k in sorted(acc):
        print(f"{k:<8} {acc[k]:>13.1%}")
    print(f"{'all':<8} {overall:>13.1%}  ({sum(total.values())} held-out prompts, {seconds:.0f} s) -> {path}")


if __name__ == "__main__":
    main()
