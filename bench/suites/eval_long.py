"""Held-out accuracy of a long-context model (tiny-long) through the engine.

The quality oracle for lossy options: dense planned path by default; --engine / --gen pass extra
engine and generation options, so the same suite measures what a sparse attention, a cache or
FP8 costs.

    python -m bench eval_long                                   # bundled tiny-long, GPU if any
    python -m bench eval_long --model /path/tiny-long --device cpu --n 5 --lengths 4096
    python -m bench eval_long --engine '{"attention": "cudnn"}' --tag cudnn

Writes long_accuracy_<model>[_<tag>].json under --out (or --json) and prints a table: exact
answers per task and context length (per-character accuracy and accuracy by needle depth are
in the JSON)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from mosaic import MosaicEngine
from mosaic.assets import long_tasks as T


def add_arguments(ap):
    ap.add_argument("--model", default="tiny-long", help="bundled name or checkpoint folder")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--n", type=int, default=100, help="held-out prompts per (task, length)")
    ap.add_argument("--lengths", default=",".join(map(str, T.LENGTHS)))
    ap.add_argument("--tasks", default=",".join(T.TASKS))
    ap.add_argument("--batch-tokens", type=int, default=262144, help="prompt tokens per request batch")
    ap.add_argument("--engine", default="{}", help="extra EngineConfig fields, JSON")
    ap.add_argument("--gen", default="{}", help="extra generation options, JSON")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    ap.add_argument("--json", type=Path, default=None, help="output file (instead of --out/long_accuracy_...)")


def output(args) -> str:
    if args.json is not None:
        return str(args.json.resolve())    # an absolute path: --out / it is it
    return f"long_accuracy_{Path(args.model).name}{'_' + args.tag if args.tag else ''}.json"


def run(args, rec) -> dict:
    engine_opts = {"device": args.device, "progress": False} | json.loads(args.engine)
    gen = json.loads(args.gen)
    t0 = time.perf_counter()
    engine = MosaicEngine(args.model, engine_opts)
    rec["load_seconds"] = round(time.perf_counter() - t0, 2)
    lengths = [int(x) for x in args.lengths.split(",")]
    rec.update(engine=engine_opts, gen=gen, lossy=engine.lossy_options())

    def write(res):
        rec.update(res)
        rec.save()

    res = T.evaluate(engine, args.tasks.split(","), lengths, args.n, args.batch_tokens, on_cell=write, **gen)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    write(res)
    return rec


def table(rec) -> str:
    per_req = [f"{c['task']}@{c['length']}: {c['seconds'] / max(c['n'], 1):.2f} s/prompt" for c in rec["cells"]]
    return T.table(rec) + "\n" + "; ".join(per_req) + f"\n{rec['seconds']} s"
