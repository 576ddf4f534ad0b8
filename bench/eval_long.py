"""Held-out accuracy of a long-context model (tiny-long) through the engine: the quality oracle
for lossy options. Dense planned path by default; --engine / --gen pass extra engine and
generation options, so the same script measures what a sparse attention, a cache or FP8 costs.

    python bench/eval_long.py                                   # bundled tiny-long, GPU if any
    python bench/eval_long.py --model /path/tiny-long --device cpu --n 5 --lengths 4096
    python bench/eval_long.py --engine '{"attention": "cudnn"}' --tag cudnn

Writes bench/results/long_accuracy_<model>[_<tag>].json (or --json) and prints a table: exact
answers per task and context length (per-character accuracy and accuracy by needle depth are
in the JSON)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import record_header

from mosaic import MosaicEngine
from mosaic.assets import long_tasks as T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-long", help="bundled name or checkpoint folder")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--n", type=int, default=100, help="held-out prompts per (task, length)")
    ap.add_argument("--lengths", default=",".join(map(str, T.LENGTHS)))
    ap.add_argument("--tasks", default=",".join(T.TASKS))
    ap.add_argument("--batch-tokens", type=int, default=262144, help="prompt tokens per request batch")
    ap.add_argument("--engine", default="{}", help="extra EngineConfig fields, JSON")
    ap.add_argument("--gen", default="{}", help="extra generation options, JSON")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    ap.add_argument("--json", type=Path, default=None, help="output file")
    args = ap.parse_args()
    engine_opts = {"device": args.device, "progress": False} | json.loads(args.engine)
    gen = json.loads(args.gen)
    t0 = time.perf_counter()
    engine = MosaicEngine(args.model, engine_opts)
    load_s = time.perf_counter() - t0
    lengths = [int(x) for x in args.lengths.split(",")]
    tasks = args.tasks.split(",")
    name = Path(args.model).name
    path = args.json or (Path(__file__).parent / "results" /
                         f"long_accuracy_{name}{'_' + args.tag if args.tag else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    header = record_header({"model": args.model, "n": args.n, "lengths": lengths, "tasks": tasks,
                            "engine": engine_opts, "gen": gen, "batch_tokens": args.batch_tokens})
    header["load_seconds"] = round(load_s, 2)

    def write(res):
        path.write_text(json.dumps(header | res, indent=2) + "\n")

    res = T.evaluate(engine, tasks, lengths, args.n, args.batch_tokens, on_cell=write, **gen)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    write(res)
    print(T.table(res))
    per_req = [f"{c['task']}@{c['length']}: {c['seconds'] / max(c['n'], 1):.2f} s/prompt" for c in res["cells"]]
    print("; ".join(per_req))
    print(f"{res['seconds']} s -> {path}")


if __name__ == "__main__":
    main()
