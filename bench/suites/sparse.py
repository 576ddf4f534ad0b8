"""Block-sparse attention: step time against dense at 128k/512k, quality on a long model.

    python -m bench sparse --out DIR [--long-model tiny-long]            # H200: ~3 min
    python -m bench sparse --full --per-layer --long-model tiny-long --quality-device cpu ...

Speed, llada-8b preset: a full-depth step at 128k (prompt N/2, N/2 masked) dense (the exact
path) and block-sparse (topk at several keep ratios, dense_steps 0 so the timed step is sparse);
at 512k the per-layer time is t(2 layers) - t(1 layer) of depth-truncated models (the head and
tail cost the same in both). Quality: the eval_long suite's tasks (mosaic/assets/long_tasks.py)
through the engine, dense vs each sparse setting, when a long-context model is given. `--full`
and `--per-layer` without lengths skip the speed parts (a CPU quality run).
"""

from __future__ import annotations

from bench.lib import engine as E
from bench.lib.measure import canvas, free, timed
from mosaic import MosaicEngine, load

KEEPS = (0.1, 0.2)


def sparse_cfg(keep: float, layers: int, dense_steps: int = 0, block: int = 128,
               estimate: str = "minmax") -> dict:
    return {"block": block, "dense_steps": dense_steps, "estimate": estimate,
            "ranges": [{"layers": [0, layers - 1], "pattern": "topk", "keep": keep, "window": 1,
                        "global_blocks": 1}]}


def one_step_ms(engine, x) -> float:
    return timed(E.step_fn(engine, x), repeat=1, warmup=0)[0]


def configs(layers: int) -> dict:
    return {"dense": {}, **{f"topk {k}": {"sparse": sparse_cfg(k, layers)} for k in KEEPS}}


def warm(model, cfgs):
    x = canvas(model, 8192, 4096)
    for kw in cfgs.values():
        E.step(MosaicEngine(model, {"progress": False, **kw}), x)
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


def add_arguments(ap):
    ap.add_argument("--full", type=int, nargs="*", default=[131072], help="full-depth step lengths")
    ap.add_argument("--per-layer", type=int, nargs="*", default=[524288], help="per-layer lengths")
    ap.add_argument("--long-model", default=None, help="a long-context model (tiny-long or a folder)")
    ap.add_argument("--quality-n", type=int, default=50)
    ap.add_argument("--quality-lengths", default="4096,8192")
    ap.add_argument("--quality-device", default="cuda", help="cpu: quality alone, no speed parts")
    ap.add_argument("--estimates", default="minmax", help="block estimates to compare: minmax,mean")


def run(args, rec) -> dict:
    rec["full"] = [speed_full(n) for n in args.full]
    rec.save()
    rec["per_layer"] = [speed_per_layer(n) for n in args.per_layer]
    rec.save()
    if args.long_model:
        try:
            def save(q):
                rec["quality"] = q
                rec.save()
            quality(args.long_model, args.quality_n, [int(s) for s in args.quality_lengths.split(",")], save,
                    args.quality_device, tuple(args.estimates.split(",")))
        except Exception as e:  # noqa: BLE001
            rec["quality_error"] = repr(e)[:500]
    return rec


def table(rec) -> str:
    lines = []
    for r in rec["full"]:
        d = r["ms"].get("dense")
        lines.append(f"N={r['tokens']:,} full depth: " + ", ".join(
            f"{k} {v / 1e3:.2f} s ({d / v:.2f}x)" for k, v in r["ms"].items() if d))
    for r in rec["per_layer"]:
        d = r["per_layer_ms"].get("dense")
        lines.append(f"N={r['tokens']:,} per layer: " + ", ".join(
            f"{k} {v / 1e3:.2f} s ({d / v:.2f}x)" for k, v in r["per_layer_ms"].items() if d))
    for k, v in rec.get("quality", {}).items():
        lines.append(f"quality {k}: " + ", ".join(f"{c['task']}@{c['length']} {c['exact']:.2f}" for c in v["cells"]))
    if "quality_error" in rec:
        lines.append(f"quality: {rec['quality_error']}")
    return "\n".join(lines)
