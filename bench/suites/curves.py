"""Memory and time against length, dense vs the options of an engine config, as one PNG.

    python -m bench curves --model tiny-llada --config engine.yaml --lengths 256 512 1024 --out DIR

For each length N (prompt N/2, N/2 masked) and each setting (dense, and the config's options
when --config is given): one timed step (MosaicEngine.step, median of --repeat after a warm-up)
and the planned peak of that step (plan + out-of-plan bytes, from the same prepare the engine
runs). Works on the CPU with the bundled models and on a GPU with the presets. Writes curves.json
and curves.png (or --png) under --out. Used by docs/TROUBLESHOOTING.md ("long inputs slow down")."""

from __future__ import annotations

from pathlib import Path

from bench.lib import engine as E
from bench.lib.measure import canvas, median, timed
from mosaic import MosaicEngine, load
from mosaic.config_file import load_engine_config


def settings(config_path) -> dict:
    out = {"dense": {"progress": False}}
    if config_path:
        cfg = load_engine_config(config_path)
        out["config"] = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__} | {"progress": False}
    return out


def measure(model, kw, n, repeat) -> dict:
    engine = MosaicEngine(model, kw)
    x = canvas(model, n, n // 2)
    times = timed(E.step_fn(engine, x), repeat=repeat, warmup=1)   # the warm-up step plans
    peak = max(h.plan_bytes + h.external_bytes for h in E.history(engine))
    return {"tokens": n, "step_ms": median(times), "planned_peak_bytes": peak}


def add_arguments(ap):
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--config", default=None, help="an engine YAML file (docs/CONFIG.md)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--png", type=Path, default=None, help="the plot (default --out/curves.png)")


def run(args, rec) -> dict:
    model = load(args.model, device=args.device)
    rec["curves"] = res = {name: [measure(model, kw | {"device": str(model.device)}, n, args.repeat)
                                  for n in args.lengths] for name, kw in settings(args.config).items()}
    rec.save()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, pts in res.items():
        n = [p["tokens"] for p in pts]
        a.plot(n, [p["step_ms"] for p in pts], "o-", label=name)
        b.plot(n, [p["planned_peak_bytes"] / 2**20 for p in pts], "o-", label=name)
    a.set(xlabel="tokens N", ylabel="one step (ms)", title="time")
    b.set(xlabel="tokens N", ylabel="planned peak (MiB)", title="memory")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{args.model}: dense vs {args.config or '-'}")
    fig.tight_layout()
    png = args.png or args.out / "curves.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    rec["png"] = str(png)
    return rec


def table(rec) -> str:
    lines = [name + ": " + ", ".join(f"N={p['tokens']} {p['step_ms']:.1f} ms {p['planned_peak_bytes'] / 2**20:.1f} MiB"
                                     for p in pts) for name, pts in rec["curves"].items()]
    return "\n".join(lines + [f"-> {rec['png']}"])
