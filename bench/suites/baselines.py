"""The baselines' L_max measured on the GPU by probing steps, not extrapolated.

    python -m bench baselines --out DIR [--quick] [--full] [--models ...] [--only ...]

For each model and baseline (native with bf16 / float64 confidences, native + expandable_segments,
native + torch.compile of the forward, Mosaic's program on PyTorch's allocator) one step is
measured at 4k/8k/16k tokens, a line through the last two peaks gives a first guess at each
budget, and the guess is then probed: steps at N, N +/- 1024, ... until N fits and N + 1024 does
not. expandable_segments is fixed at process start: those probes run in a child
process (`python -m bench baselines --expandable ...`).

Every probe is one step of a depth-truncated model (1 layer) charged the full weights, as in the
capacity suite: the native step's peak is its logits and sampler tensors, after the last layer,
so depth does not change it (checked there at 16k: 1.21 GB both). A probe that runs out of
device memory counts as not fitting."""

from __future__ import annotations

import tempfile
import time

import torch

from bench.lib import engine as E
from bench.lib.exact import baseline_step_fn
from bench.lib.measure import canvas, expandable_env, free, reset_peaks
from bench.lib.record import child_record
from mosaic import MosaicEngine, load

GiB = 2**30
MODELS = ("llada-8b", "dream-7b", "llada-moe-7b")
STEP = 1024
# Device time per model measured on the H200 (part_d.log, baselines_native.log): native, float64
# and expandable 2-14 s each; torch.compile 110-120 s (dense) and over 230 s (MoE: 19 graph
# breaks, recompiled per probed length); mask-only eager 250 s for LLaDA-8B and more for the
# others (steps at 0.2-1.9 M tokens). The default keeps a run near 10 minutes.
DEFAULT = {"native_model", "native_float64", "native_expandable"}
COMPILED_BY_DEFAULT = ("llada-8b",)


def add_arguments(ap):
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="baselines to measure (default: the default set)")
    ap.add_argument("--quick", action="store_true", help="20 GiB, 1k/2k tokens, llada-8b: a smoke run")
    ap.add_argument("--full", action="store_true", help="also torch.compile of every model and mask-only eager")
    ap.add_argument("--expandable", action="store_true",
                    help="only native + expandable_segments, in this process (what the child runs)")


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
        info["graphs"] = dynamo.explain(E.native_forward(engine))(ids, None).graph_count
        E.compile_native_forward(engine)
    native = variant.startswith("native")
    conf = "float64" if variant == "native_float64" else "model"

    def peak(n: int) -> int | None:
        x = canvas(model, n, n // 2)
        fn = baseline_step_fn(engine, x, native, conf)
        try:
            if variant == "native_compiled":  # compile (and recompile for a new shape) first
                fn()
            free()
            reset_peaks()
            fn()
            torch.cuda.synchronize()
            return E.counters_peak(engine)
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


def expandable_child(models, quick: bool) -> list:
    """native + expandable_segments: the allocator mode is fixed at process start, so a child."""
    free()
    with tempfile.TemporaryDirectory() as tmp:
        child = child_record("baselines", ["--expandable", "--models", *models] + (["--quick"] if quick else []),
                             tmp, env=expandable_env())
    if "baselines" not in child:
        return [child]
    return list(child["baselines"].values())


def run(args, rec) -> dict:
    """The default baselines (--full: all of them; --only: those named) of every model; the
    record is saved after each baseline."""
    budgets = (20,) if args.quick else (24, 40, 80)
    lengths = (1024, 2048) if args.quick else (4096, 8192, 16384)
    models = args.models or (MODELS[:1] if args.quick else MODELS)
    res = rec.setdefault("baselines", {})

    def keep(r):
        res[r["model"]] = r
        rec.save()
    if args.expandable:
        for m in models:
            measure(m, budgets, lengths, True, done=keep)
        return rec
    for m in models:
        measure(m, budgets, lengths, only=args.only, done=keep, full=args.full or bool(args.only))
    if not args.only or "native_expandable" in args.only:
        for m in expandable_child(models, args.quick):
            if "model" in m:
                res.setdefault(m["model"], {"model": m["model"], "variants": {}})["variants"].update(m["variants"])
                keep(res[m["model"]])
            else:
                rec["expandable_error"] = m.get("error")
    return rec


def table(rec) -> str:
    return "\n".join(f"{'baseline':<10} {m:<12} {v:<18} L_max {x['l_max']} probes "
                     f"{sum(len(p) for p in x['probes'].values())}"
                     for m, r in rec.get("baselines", {}).items() for v, x in r.get("variants", {}).items())
