"""Issue 7: the baselines' L_max measured on the GPU, not extrapolated. For each model and
baseline (native with bf16 / float64 confidences, native + expandable_segments, native +
torch.compile of the forward, Mosaic's program on PyTorch's allocator) one step is measured at
4k/8k/16k tokens, a line through the last two peaks gives a first guess at each budget, and the
guess is then probed: steps at N, N +/- 1024, ... until N fits and N + 1024 does not.

Every probe is one step of a depth-truncated model (1 layer) charged the full weights, as in
bench_capacity.verify: the native step's peak is its logits and sampler tensors, after the last
layer, so depth does not change it (checked there at 16k: 1.21 GB both). A probe that runs out of
device memory counts as not fitting.

    python bench/bench_baselines.py --out DIR [--quick]     # the GPU suite runs it as part d
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
from bench_capacity import step_fns_gen
from bench_memory import peak_counters
from common import canvas, expandable_env, free, reset_peaks

from mosaic import MosaicEngine, load

GiB = 2**30
MODELS = ("llada-8b", "dream-7b", "llada-moe-7b")
STEP = 1024


# Device time per model measured on the H200 (part_d.log, baselines_native.log): native, float64
# and expandable 2-14 s each; torch.compile 110-120 s (dense) and over 230 s (MoE: 19 graph
# breaks, recompiled per probed length); mask-only eager 250 s for LLaDA-8B and more for the
# others (steps at 0.2-1.9 M tokens). The default keeps `gpu_suite.py --part all` near 20 minutes.
DEFAULT = {"native_model", "native_float64", "native_expandable"}
COMPILED_BY_DEFAULT = ("llada-8b",)


def variants(name: str, expandable: bool, full: bool = True) -> list[str]:
    if expandable:
        return ["native_expandable"]
    out = ["native_model", "native_compiled", "mask_only_eager"]
    out = out if name == "dream-7b" else out + ["native_float64"]
    if not full:
        out = [v for v in out if v in DEFAULT or (v == "native_compiled" and name in COMPILED_BY_DEFAULT)]
    return out


def prober(model, variant: str):
    """peak(n) -> device bytes of one step at n tokens (M = n/2), or None when out of memory."""
    engine = MosaicEngine(model, {"progress": False, "arena": "host"})
    info = {}
    if variant == "native_compiled":
        import torch._dynamo as dynamo
        dynamo.config.recompile_limit = 64  # the row-tile loops specialise on N: compile every probe
        ids = torch.zeros(1, 64, dtype=torch.long, device=model.device)
        info["graphs"] = dynamo.explain(engine.native_runner.forward)(ids, None).graph_count
        engine.native_runner.forward = torch.compile(engine.native_runner.forward)
    native = variant.startswith("native")
    conf = "float64" if variant == "native_float64" else "model"

    def peak(n: int) -> int | None:
        x = canvas(model, n, n // 2)
        fn = step_fns_gen(engine, x, native, conf)
        try:
            if variant == "native_compiled":  # compile (and recompile for a new shape) first
                fn()
            free()
            reset_peaks()
            fn()
            torch.cuda.synchronize()
            return peak_counters(engine)
        except torch.OutOfMemoryError:
            return None
        finally:
            del x, fn
            free()
    return peak, info


def search(peak, guess: int, budget: int, probes: list, max_probes: int = 24) -> int:
    """The largest multiple of STEP that fits, starting at guess: widen until bracketed, bisect."""
    def fits(n):
        assert len(probes) < max_probes, f"no bracket after {max_probes} probes: {probes}"
        b = peak(n)
        probes.append([n, b])
        return b is not None and b <= budget
    n, step = max(STEP, guess // STEP * STEP), STEP
    if fits(n):
        lo = n
        while fits(lo + step):
            lo, step = lo + step, 2 * step
        hi = lo + step
    else:
        hi, lo = n, None
        while lo is None:
            cand = max(STEP, hi - step)
            if cand == hi:
                return 0
            if fits(cand):
                lo = cand
            else:
                hi, step = cand, 2 * step
    while hi - lo > STEP:
        mid = (lo + hi) // 2 // STEP * STEP
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def measure(name: str, budgets, lengths, expandable=False, only=None, done=lambda r: None,
            full: bool = True) -> dict:
    model = load(name, device="cuda", num_layers=1)
    out = {"model": name, "lengths": list(lengths), "variants": {}}
    for variant in variants(name, expandable, full):
        if only and variant not in only:
            continue
        t0 = time.perf_counter()
        peak, info = prober(model, variant)
        peaks = [peak(n) for n in lengths]
        slope = (peaks[-1] - peaks[-2]) / (lengths[-1] - lengths[-2])
        res = {**info, "peaks": peaks, "bytes_per_token": slope, "l_max": {}, "probes": {}}
        for gb in budgets:
            guess = int((gb * GiB - peaks[-1]) / slope) + lengths[-1]
            probes = []
            res["l_max"][str(gb)] = search(peak, guess, gb * GiB, probes)
            res["probes"][str(gb)] = probes
        res["seconds"] = time.perf_counter() - t0
        print(f"  {name} {variant}: L_max {res['l_max']} ({res['seconds']:.0f} s)", flush=True)
        out["variants"][variant] = res
        done(out)
        del peak
        free()
    del model
    free()
    return out


def expandable_child(models, budgets, lengths) -> list:
    """native + expandable_segments: the allocator mode is fixed at process start, so a child."""
    free()
    code = ("import json,sys; sys.path.insert(0,'.'); from bench_baselines import measure; "
            f"print(json.dumps([measure(m, {list(budgets)}, {list(lengths)}, True) for m in {list(models)}]))")
    r = subprocess.run([sys.executable, "-c", code], env=expandable_env(), capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
    print(r.stdout[-3000:-1] if r.returncode == 0 else r.stderr[-3000:], flush=True)
    if r.returncode:
        return [{"error": r.stderr[-3000:]}]
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(quick: bool = False, out=None, models=None, only=None, full: bool = False) -> dict:
    """The default baselines (full: all of them; only: those named) of every model; with out,
    results are kept after each one."""
    budgets = (20,) if quick else (24, 40, 80)
    lengths = (1024, 2048) if quick else (4096, 8192, 16384)
    models = models or (MODELS[:1] if quick else MODELS)
    res = {}

    def keep(r):
        res[r["model"]] = r
        if out is not None:
            (out / "baselines_partial.json").write_text(json.dumps(res, indent=1) + "\n")
    for m in models:
        measure(m, budgets, lengths, only=only, done=keep, full=full or bool(only))
    if not only or "native_expandable" in only:
        for m in expandable_child(models, budgets, lengths):
            if "model" in m:
                res.setdefault(m["model"], {"model": m["model"], "variants": {}})["variants"].update(m["variants"])
                keep(res[m["model"]])
    return res


def main():
    import argparse
    from pathlib import Path

    from common import record_header
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="baselines to measure (default: all)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--full", action="store_true", help="also torch.compile of every model and mask-only eager")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res = run(args.quick, args.out, args.models, args.only, args.full)
    rec = {**record_header(vars(args) | {"out": str(args.out)}), "sections": {"baselines": res}}
    (args.out / "baselines.json").write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
