"""Where a step's time goes: a per-kernel breakdown of one denoising step (GPU).

    python -m bench profile --model llada-8b --tokens 8192 32768 --out DIR

One step under torch.profiler on the native and the planned path, with the compute floor (FLOPs
/ measured bf16 matmul rate) beside it. Kernels are grouped by what they do (attention, GEMM,
elementwise/norm, logits reduction, copies, other); each group's share of the step and the top
kernels are written to profile_<model>.json."""

from __future__ import annotations

from bench.lib import engine as E
from bench.lib.floors import floor_ms, matmul_rate, step_flops
from bench.lib.measure import canvas, free, median, timed
from bench.lib.profiler import profile
from mosaic import MosaicEngine, load


def add_arguments(ap):
    ap.add_argument("--model", default="llada-8b")
    ap.add_argument("--tokens", type=int, nargs="*", default=[8192, 32768])


def output(args) -> str:
    return f"profile_{args.model}.json"


def run(args, rec) -> dict:
    rate = matmul_rate()
    rec["matmul_tflops"] = rate
    engine = MosaicEngine(load(args.model, device="cuda"), {"progress": False})
    cfg = engine.model.cfg
    rec["runs"] = []
    for n in args.tokens:
        x = canvas(engine.model, n, n // 2)
        fl = step_flops(cfg, n, n // 2)
        for native in (True, False):
            ms = median(timed(E.step_fn(engine, x, native=native), repeat=3))
            prof = profile(engine, x, native)
            r = {"tokens": n, "masked": n // 2, "path": "native" if native else "mosaic", "step_ms": ms,
                 "flops": fl, "compute_floor_ms": floor_ms(fl, rate), **prof}
            r["x_floor"] = ms / r["compute_floor_ms"]
            rec["runs"].append(r)
            rec.save()
            free()
    return rec


def table(rec) -> str:
    lines = [f"matmul ceiling {rec['matmul_tflops']:.0f} TFLOP/s",
             f"{'N':>7} {'path':>7} {'step ms':>9} {'floor ms':>9} {'x floor':>8}  groups (ms)"]
    for r in rec["runs"]:
        g = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["groups_ms"].items(), key=lambda kv: -kv[1]))
        lines.append(f"{r['tokens']:>7} {r['path']:>7} {r['step_ms']:>9.1f} {r['compute_floor_ms']:>9.1f} "
                     f"{r['x_floor']:>8.2f}  {g}")
    return "\n".join(lines)
