"""Block-sparse attention: step time against dense at 128k and 512k tokens, and quality on the
long-context bundled model (issue 16).

    python bench/bench_sparse.py --out $OUT [--long-model mosaic/assets/tiny-long]   # H200: ~3 min

Speed, llada-8b preset: a full-depth step at 128k (prompt N/2, N/2 masked) dense (the exact
path) and block-sparse (topk at several keep ratios, dense_steps 0 so the timed step is sparse);
at 512k the per-layer time is t(2 layers) - t(1 layer) of depth-truncated models (the head and
tail cost the same in both). Quality: bench/eval_long.py's tasks through the engine, dense vs
each sparse setting, when a long-context model folder is given.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from common import canvas, free, record_header

from mosaic import MosaicEngine, load

KEEPS = (0.1, 0.2)


def sparse_cfg(keep: float, layers: int, dense_steps: int = 0, block: int = 128,
               estimate: str = "minmax") -> dict:
    return {"block": block, "dense_steps": dense_steps, "estimate": estimate,
            "ranges": [{"layers": [0, layers - 1], "pattern": "topk", "keep": keep, "window": 1,
                        "global_blocks": 1}]}


def one_step_ms(engine, x) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.step(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def configs(layers: int) -> dict:
    return {"dense": {}, **{f"topk {k}": {"sparse": sparse_cfg(k, layers)} for k in KEEPS}}


def warm(model, cfgs):
    x = canvas(model, 8192, 4096)
    for kw in cfgs.values():
        MosaicEngine(model, {"progress": False, **kw}).step(x)
    free()


def speed_full(n: int) -> dict:
    model = load("llada-8b", device="cuda")
    cfgs = configs(model.cfg.num_layers)
    warm(model, cfgs)
    x = canvas(model, n, n // 2)
    rec = {"tokens": n, "layers": model.cfg.num_layers, "ms": {}}
    for name, kw in cfgs.items():
        try:
            rec["ms"][name] = one_step_ms(MosaicEngine(model, {"progress": False, **kw}), x)
        except Exception as e:  # noqa: BLE001
            rec.setdefault("errors", {})[name] = repr(e)[:300]
        free()
        print(f"  {n:,} full depth {name}: {rec['ms'].get(name, 0) / 1e3:.2f} s", flush=True)
    del model
    free()
    return rec


def speed_per_layer(n: int) -> dict:
    rec = {"tokens": n, "ms": {}}
    for layers in (1, 2):
        model = load("llada-8b", device="cuda", num_layers=layers)
        cfgs = configs(layers)
        warm(model, cfgs)
        x = canvas(model, n, n // 2)
        for name, kw in cfgs.items():
            try:
                rec["ms"].setdefault(name, {})[layers] = one_step_ms(MosaicEngine(model, {"progress": False, **kw}), x)
            except Exception as e:  # noqa: BLE001
                rec.setdefault("errors", {})[f"{name}/{layers}"] = repr(e)[:300]
            free()
        del model, x
        free()
    rec["per_layer_ms"] = {k: v[2] - v[1] for k, v in rec["ms"].items() if 1 in v and 2 in v}
    for k, v in rec["per_layer_ms"].items():
        print(f"  {n:,} per layer {k}: {v / 1e3:.2f} s", flush=True)
    return rec


def quality(folder: str, n: int, lengths, save=lambda out: None, device: str = "cuda",
            estimates=("minmax",)) -> dict:
    """Exact-answer accuracy per task and length: dense, then each keep ratio with 0 and 1
    dense steps for each block estimate (block 64: 4k-16k contexts have 64-256 key blocks);
    `save(out)` after each setting, so a run cut by a time limit keeps the settings it finished."""
    from mosaic.assets import long_tasks as T
    layers = load(folder, device="meta").cfg.num_layers
    settings = {"dense": {}}
    for est in estimates:
        for keep in KEEPS:
            for ds in (0, 1):
                tag = "" if est == "minmax" else f" {est}"
                settings[f"topk {keep} dense_steps {ds}{tag}"] = {"sparse": sparse_cfg(keep, layers, ds, 64, est)}
    out = {}
    for name, kw in settings.items():
        engine = MosaicEngine(folder, {"device": device, "progress": False, **kw})
        out[name] = T.evaluate(engine, T.TASKS, lengths, n)
        print(f"  quality {name}: " + ", ".join(f"{c['task']}@{c['length']} {c['exact']:.2f}"
                                               for c in out[name]["cells"]), flush=True)
        del engine
        free()
        save(out)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu"))
    ap.add_argument("--full", type=int, nargs="*", default=[131072])
    ap.add_argument("--per-layer", type=int, nargs="*", default=[524288])
    ap.add_argument("--long-model", default=None)
    ap.add_argument("--quality-n", type=int, default=50)
    ap.add_argument("--quality-lengths", default="4096,8192")
    ap.add_argument("--quality-device", default="cuda", help="cpu: quality alone, no speed parts")
    ap.add_argument("--estimates", default="minmax", help="block estimates to compare: minmax,mean")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_sparse.json"
    rec = record_header({k: str(v) for k, v in vars(args).items()})
    rec["full"] = [speed_full(n) for n in args.full]
    path.write_text(json.dumps(rec, indent=1))
    rec["per_layer"] = [speed_per_layer(n) for n in args.per_layer]
    path.write_text(json.dumps(rec, indent=1))
    if args.long_model:
        try:
            def save(q):
                rec["quality"] = q
                path.write_text(json.dumps(rec, indent=1))
            quality(args.long_model, args.quality_n, [int(s) for s in args.quality_lengths.split(",")], save,
                    args.quality_device, tuple(args.estimates.split(",")))
        except Exception as e:  # noqa: BLE001
            rec["quality_error"] = repr(e)[:500]
        path.write_text(json.dumps(rec, indent=1))
    for r in rec["full"]:
        d = r["ms"].get("dense")
        print(f"N={r['tokens']:,} full depth: " + ", ".join(
            f"{k} {v / 1e3:.2f} s ({d / v:.2f}x)" for k, v in r["ms"].items() if d))
    for r in rec["per_layer"]:
        d = r["per_layer_ms"].get("dense")
        print(f"N={r['tokens']:,} per layer: " + ", ".join(
            f"{k} {v / 1e3:.2f} s ({d / v:.2f}x)" for k, v in r["per_layer_ms"].items() if d))
    for k, v in rec.get("quality", {}).items():
        print(f"quality {k}: " + ", ".join(f"{c['task']}@{c['length']} {c['exact']:.2f}" for c in v["cells"]))


if __name__ == "__main__":
    main()
