"""Where a batched round's wall time goes: generate() of B prompts (llada-8b preset, dual 0.9,
1k + 128, block 32) warm, then the same call under cProfile (host functions by own and
cumulative time) and under torch.profiler (GPU busy time: the sum of kernel durations over the
unprofiled call's wall). Usage: python -m bench.probes.round_profile --batch 1 16 --out DIR"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

import torch

from bench.lib.measure import canvas
from mosaic import MosaicEngine, load

OPTS = dict(max_new_tokens=128, block_length=32, steps=128, cache="dual", threshold=0.9)


def top(stats, key: int, n: int = 30):
    rows = sorted(((v[key], f"{k[0].split('mosaic/')[-1]}:{k[1]}:{k[2]}", v[1]) for k, v in stats.stats.items()),
                  reverse=True)[:n]
    return [{"s": round(t, 4), "fn": f, "calls": c} for t, f, c in rows]


def gpu_busy(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ev = [e for e in p.events() if e.device_type.name == "CUDA"]
    busy = sum(e.device_time for e in ev) / 1e6
    by = {}
    for e in ev:
        by[e.name[:90]] = by.get(e.name[:90], 0) + e.device_time / 1e3
    return {"wall_s": wall, "kernel_s": busy, "busy": busy / wall,
            "top_ms": sorted(((round(v, 2), k) for k, v in by.items()), reverse=True)[:25]}


def step_kernels(eng, B: int) -> dict | None:
    """The kernels of the most replayed captured block step of this batch ('pool': stacked)."""
    from bench.lib.profiler import kernel_breakdown
    kind = "pool" if B > 1 else "block"
    found = [c for k, c in eng.graphs.graphs.items() if k[3] and k[3][0] == kind]
    if not found:
        return None
    g = max(found, key=lambda c: c.replays).graph
    return kernel_breakdown(g.replay, repeat=10, top=30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--out", default="bench/out")
    a = ap.parse_args()
    model = load("llada-8b", device="cuda")
    eng = MosaicEngine(model, {"progress": False})
    res = []
    for B in a.batch:
        ids = [[t for t in canvas(model, 1024, 0, seed=i)[0].tolist() if t != model.cfg.mask_id] for i in range(B)]
        arg = ids if B > 1 else ids[0]
        eng.generate(arg, **OPTS)
        t0 = time.perf_counter()
        out = eng.generate(arg, **OPTS)
        wall = time.perf_counter() - t0
        prof = cProfile.Profile()
        prof.enable()
        eng.generate(arg, **OPTS)
        prof.disable()
        st = pstats.Stats(prof)
        g = out[0] if isinstance(out, list) else out
        r = {"batch": B, "wall_s": wall, "tok_per_s": B * 128 / wall, "nfe": g.stats.get("nfe"),
             "tottime": top(st, 2), "cumtime": top(st, 3), "gpu": gpu_busy(lambda: eng.generate(arg, **OPTS))}
        r["step_kernels"] = step_kernels(eng, B)
        # the profiler slows the host: GPU busy is its kernels' time over the unprofiled wall
        r["gpu_busy_of_wall"] = r["gpu"]["kernel_s"] / wall
        head = {k: r[k] for k in ("batch", "wall_s", "tok_per_s", "nfe", "gpu_busy_of_wall")}
        print(json.dumps(head), flush=True)
        res.append(r)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "round_profile.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
