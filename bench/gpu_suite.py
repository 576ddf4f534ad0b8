"""The GPU suite: every figure the README quotes, in four parts that each fit one 10-minute run.

    python bench/gpu_suite.py --part a --out $OUT    # steps, kernel, native 4k, bundled tokens
    python bench/gpu_suite.py --part b --out $OUT    # arena, budget, inflation, depth, baselines
    python bench/gpu_suite.py --part c --out $OUT    # capacity: L_max verified at the budgets
    python bench/gpu_suite.py --part d --out $OUT    # baselines' L_max probed; GPU memory plot
    python bench/gpu_suite.py --part all --out $OUT  # everything: ~18 min by the parts' measured times
    python bench/gpu_suite.py --quick --part all     # a smoke run of everything, small sizes

Each section's result is written as soon as it is done (part_<x>.json); a failing section is
recorded with its error and the others still run. A short table is printed last."""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

from common import free, record_header

GiB = 2**30


def sections(part: str, quick: bool, ratio1: bool = False, out: Path = Path(".")):
    import bench_baselines as BL
    import bench_capacity as C
    import bench_kernel as K
    import bench_memory as Mm
    import bench_steps as S
    a = {
        "bundled_tokens": S.bundled_tokens,
        "native_4k": lambda: [S.native_4k(m) for m in ("llada-8b", "dream-7b", "llada-moe-7b")],
        "kernel": lambda: K.run(ms=(1024,) if quick else (1024, 16384, 131072)),
        "steps": lambda: [S.run_model(m, (2048,) if quick else (8192, 32768), quick)
                          for m in ("llada-8b", "dream-7b")],
        "par": lambda: S.with_engine("llada-8b", lambda e: S.par(e, 4096 if quick else 32768)),
        "e2e": lambda: S.with_engine("llada-8b", lambda e: [S.e2e(e, n) for n in
                                                           ((2048,) if quick else (8192, 32768))]),
    }
    b = {
        "vmm_cycles": lambda: Mm.vmm_cycles(10 if quick else 100),
        "budget_steps": lambda: Mm.budget_steps(10 if quick else 200, "40GiB", 8192 if quick else 49152),
        "budget_tight": lambda: Mm.budget_steps(5 if quick else 40, "17GiB", 8192 if quick else 49152),
        "inflation": lambda: Mm.inflation((8192,) if quick else (32768, 131072)),
        "depth_check": lambda: C.depth_check(n=4096 if quick else 16384),
        "chunk_overhead": lambda: C.chunk_overhead(n=8192 if quick else 65536),
        "native_peaks": lambda: [C.native_peaks(m, (2048, 4096) if quick else (4096, 8192, 16384))
                                 for m in ("llada-8b", "dream-7b", "llada-moe-7b")],
    }
    c = {
        "vmm_cycles": lambda: Mm.vmm_cycles(10 if quick else 100),
        "capacity_llada": lambda: C.verify("llada-8b", "18GiB" if quick else "40GiB",
                                           (1.0,) if ratio1 else (1.0, 0.1)),
        "capacity_moe": lambda: C.verify("llada-moe-7b", "17GiB" if quick else "40GiB", (1.0,)),
        "capacity_dream": lambda: C.verify("dream-7b", "17GiB" if quick else "24GiB", (1.0,)),
    }
    d = {
        "baselines": lambda: BL.run(quick, out),
        "memory_plot": lambda: S.memory_plot(out, 2048 if quick else 8192),
    }
    return {"a": a, "b": b, "c": c, "d": d, "all": {**a, **b, **c, **d}}[part]


def summary(res: dict) -> list[str]:
    lines = []
    for name, val in res.items():
        if isinstance(val, dict) and "error" in val:
            lines.append(f"{name:<16} ERROR {val['error'].splitlines()[-1][:100]}")
        elif name == "steps":
            for m in val:
                for n, r in m["lengths"].items():
                    lines.append(f"{'step':<16} {m['model']:<12} N={n:>7} native {r['native_step_ms']:8.0f} ms "
                                 f"{r['native_peak_bytes'] / GiB:6.1f} GiB | mosaic {r['mosaic_step_ms']:8.0f} ms "
                                 f"{r['mosaic_peak_bytes'] / GiB:6.1f} GiB | x{r['latency_ratio']:.2f} "
                                 f"err {r['masked_logits_rel_err']:.1e}")
        elif name == "kernel":
            for r in val:
                lines.append(f"{'kernel':<16} {r['model']:<12} M={r['M']:>7} fused {r['fused_ms']:7.2f} ms "
                             f"({r['fused_vs_cublas']:.0%} cuBLAS, {r['fused_vs_torch']:.2f}x torch) extra "
                             f"{r['fused_extra_bytes'] / 2**20:.2f} MiB")
        elif name.startswith("capacity"):
            for r in val["runs"]:
                lines.append(f"{name:<16} N={val['report']['l_max']:>9,} ratio {r['mask_ratio']} measured "
                             f"{r['measured_bytes'] / GiB:.2f} GiB predicted {r['predicted_bytes'] / GiB:.2f} "
                             f"GiB err {100 * r['prediction_error']:+.1f}% ok={r['within_budget']}")
        elif name == "baselines":
            for m, r in val.items():
                for v, x in r.get("variants", {}).items():
                    lines.append(f"{'baseline':<16} {m:<12} {v:<18} L_max {x['l_max']} probes "
                                 f"{sum(len(p) for p in x['probes'].values())}")
        elif name == "memory_plot":
            lines.append(f"{'memory_plot':<16} " + ", ".join(f"{k}: {v['peak_bytes'] / GiB:.2f} GiB"
                                                          for k, v in val["series"].items()))
        elif name == "inflation":
            for r in val:
                lines.append(f"{'inflation':<16} N={r['tokens']:>7} arena {r['arena']['inflation']:+.4f} caching "
                             f"{r['caching']['inflation']:+.4f} expandable {r['expandable'].get('inflation')}")
        else:
            lines.append(f"{name:<16} {json.dumps(val, default=str)[:150]}")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="a", choices=["a", "b", "c", "d", "all"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--ratio1", action="store_true", help="capacity probes at mask ratio 1 only")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"part_{args.part}{'_quick' if args.quick else ''}.json"
    rec = {**record_header({"part": args.part, "quick": args.quick}), "sections": {}, "seconds": {}}
    for name, fn in sections(args.part, args.quick, args.ratio1, args.out).items():
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            rec["sections"][name] = fn()
        except Exception as e:  # record it and go on: one section must not lose the others
            rec["sections"][name] = {"error": "".join(traceback.format_exception(e))[-4000:]}
            print(rec["sections"][name]["error"], flush=True)
        rec["seconds"][name] = time.perf_counter() - t0
        free()
        path.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    print("\n".join(summary(rec["sections"])))
    print(f"seconds: {json.dumps({k: round(v) for k, v in rec['seconds'].items()})}")


if __name__ == "__main__":
    main()
