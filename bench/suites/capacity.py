"""L_max predicted by the capacity planner and verified on the GPU; depth check; chunking.

    python -m bench capacity --out DIR [--quick] [--only capacity_llada ...] [--ratio1]

Sections:
  capacity_llada / capacity_moe / capacity_dream
                  the planner's L_max at 40 / 40 / 24 GiB (--quick: 17-18 GiB), then the
                  capacity probe run at it (mask ratio 1 and 0.1 for LLaDA; --ratio1: 1 only)
  depth_check     activation peak of a planned step: full depth vs one layer, same N and M
  chunk_overhead  step time with the chunk counts a tight budget forces vs unchunked
  native_peaks    peak device bytes of one native step (and of Mosaic's program on PyTorch's
                  allocator) at a few N: they grow linearly in N
Verification runs on a depth-truncated model charged the full model's weight bytes
(DESIGN.md section 5) and reads the device's own counters: context + PyTorch's peak reserved +
the arena's mapped peak + the missing weights."""

from __future__ import annotations

import time

import torch

from bench.lib import engine as E
from bench.lib.exact import baseline_step_fn
from bench.lib.measure import canvas, free, median, reset_peaks, timed
from mosaic import GenerationConfig, MosaicEngine, load
from mosaic.memory.accounting import context_bytes
from mosaic.policy.capacity import capacity_report

GiB = 2**30
SECTIONS = ("capacity_llada", "capacity_moe", "capacity_dream", "depth_check", "chunk_overhead", "native_peaks")


def add_arguments(ap):
    ap.add_argument("--quick", action="store_true", help="small sizes and budgets: a smoke run")
    ap.add_argument("--only", nargs="*", choices=SECTIONS)
    ap.add_argument("--ratio1", action="store_true", help="capacity probes at mask ratio 1 only")


def verify(name: str, budget: str, ratios=(1.0,), layers: int = 1) -> dict:
    model = load(name, device="cuda", num_layers=layers)
    engine = MosaicEngine(model, {"progress": False, "memory_budget": budget})
    # the prediction uses the engine's own accounting (context measured after loading, workspace
    # measured by its warm-up)
    b = E.budget(engine)
    rep = capacity_report(load(name, device="meta"), budget, context_bytes=b.context_bytes,
                          workspace_bytes=b.workspace_bytes)
    n = rep["l_max"]
    runs = []
    for r in ratios:
        m = max(1, round(0.5 * n * r))
        predicted = E.admit(engine, 1, n, GenerationConfig(max_new_tokens=m)).predicted_bytes
        x = canvas(model, n, m)
        reset_peaks()
        t0 = time.perf_counter()
        E.step(engine, x)
        torch.cuda.synchronize()
        measured = E.counters_peak(engine)
        chunks = E.last_chunks(engine)
        runs.append({"mask_ratio": r, "masked": m, "chunks": chunks, "seconds": time.perf_counter() - t0,
                     "predicted_bytes": predicted, "measured_bytes": measured,
                     "prediction_error": (predicted - measured) / measured,
                     "within_budget": measured <= rep["budget_bytes"]})
        print(f"  {name} @ {budget}: N={n:,} M={m:,} chunks={chunks} measured {measured / GiB:.2f} GiB, "
              f"predicted {predicted / GiB:.2f} GiB, {runs[-1]['seconds']:.0f} s", flush=True)
        del x
        free()
    del engine, model
    free()
    return {"model": name, "budget": budget, "layers": layers, "report": rep, "runs": runs}


def depth_check(name="llada-8b", n=16384) -> dict:
    """Activation peak of a planned step: full depth vs one layer (same N, same M)."""
    out = {}
    for layers in (None, 1):
        model = load(name, device="cuda", num_layers=layers)
        engine = MosaicEngine(model, {"progress": False})
        x = canvas(model, n, n // 2)
        E.step(engine, x)
        reset_peaks()
        base = torch.cuda.memory_allocated()
        E.step(engine, x)
        torch.cuda.synchronize()
        vmm = E.arena_mapped_bytes(engine) if E.arena_kind(engine) == "vmm" else 0
        act = torch.cuda.max_memory_allocated() - base + vmm
        out["full" if layers is None else "one_layer"] = {"activation_peak_bytes": act,
                                                          "plan_bytes": E.history(engine)[-1].plan_bytes}
        del engine, model, x
        free()
    out["same"] = out["full"]["plan_bytes"] == out["one_layer"]["plan_bytes"]
    out["measured_rel_diff"] = abs(out["full"]["activation_peak_bytes"] - out["one_layer"]["activation_peak_bytes"]) \
        / out["full"]["activation_peak_bytes"]
    return out


def chunk_overhead(name="llada-8b", n=65536, layers=2) -> dict:
    """Step time with the chunk counts a tight budget forces vs unchunked, same N and M."""
    from mosaic.memory.accounting import FIXED_BYTES, input_bytes
    model = load(name, device="cuda", num_layers=layers)
    floor = 2 * (model.cfg.hidden + 2 * model.cfg.kv_dim) * n
    budget = model.weight_bytes() + context_bytes(torch.device("cuda")) + FIXED_BYTES + input_bytes(1, n) \
        + int(1.3 * floor)
    x = canvas(model, n, n // 2)
    res = {"model": name, "tokens": n, "layers": layers, "budget_bytes": budget}
    for label, conf in (("unchunked", {}), ("chunked", {"memory_budget": budget})):
        engine = MosaicEngine(model, {"progress": False, **conf})
        res[f"{label}_ms"] = median(timed(E.step_fn(engine, x), repeat=3))
        res[f"{label}_chunks"] = E.last_chunks(engine)
        del engine
        free()
    res["overhead"] = res["chunked_ms"] / res["unchunked_ms"] - 1
    del model, x
    free()
    return res


def native_peaks(name: str, lengths=(4096, 8192, 16384), variants=("model", "float64"), layers=1,
                 eager_masked=True) -> dict:
    """Peak device bytes of one step of the native path (and of Mosaic's program on PyTorch's
    allocator: mask-only logits, no arena, no chunking) at a few N: they grow linearly in N."""
    model = load(name, device="cuda", num_layers=layers)
    out = {"model": name, "lengths": list(lengths), "layers": layers}
    runs = [(f"native_{v}", True, v) for v in variants if name != "dream-7b" or v == "model"]
    if eager_masked:
        runs.append(("mask_only_eager", False, "model"))
    for label, native, conf in runs:
        peaks = []
        for n in lengths:
            engine = MosaicEngine(model, {"progress": False, "arena": "host"})
            x = canvas(model, n, n // 2)
            fn = baseline_step_fn(engine, x, native, conf)
            reset_peaks()
            fn()
            torch.cuda.synchronize()
            peaks.append(E.counters_peak(engine))
            del engine, x, fn
            free()
        out[label] = peaks
    del model
    free()
    return out


def run(args, rec) -> dict:
    q = args.quick
    sections = {
        "capacity_llada": lambda: verify("llada-8b", "18GiB" if q else "40GiB", (1.0,) if args.ratio1 else (1.0, 0.1)),
        "capacity_moe": lambda: verify("llada-moe-7b", "17GiB" if q else "40GiB", (1.0,)),
        "capacity_dream": lambda: verify("dream-7b", "17GiB" if q else "24GiB", (1.0,)),
        "depth_check": lambda: depth_check(n=4096 if q else 16384),
        "chunk_overhead": lambda: chunk_overhead(n=8192 if q else 65536),
        "native_peaks": lambda: [native_peaks(m, (2048, 4096) if q else (4096, 8192, 16384))
                                 for m in ("llada-8b", "dream-7b", "llada-moe-7b")],
    }
    for name in args.only or SECTIONS:
        rec.case(name, sections[name], into="sections")
        free()
    return rec


def table(rec) -> str:
    lines = []
    for name, val in rec.get("sections", {}).items():
        if isinstance(val, dict) and "error" in val:
            lines.append(f"{name:<16} ERROR {val['error'].splitlines()[-1][:100]}")
        elif name.startswith("capacity"):
            for r in val["runs"]:
                lines.append(f"{name:<16} N={val['report']['l_max']:>9,} ratio {r['mask_ratio']} measured "
                             f"{r['measured_bytes'] / GiB:.2f} GiB predicted {r['predicted_bytes'] / GiB:.2f} "
                             f"GiB err {100 * r['prediction_error']:+.1f}% ok={r['within_budget']}")
        elif name == "depth_check":
            lines.append(f"{name:<16} same plan {val['same']}, measured difference {val['measured_rel_diff']:.2%}")
        elif name == "chunk_overhead":
            lines.append(f"{name:<16} N={val['tokens']:,} chunks {val['chunked_chunks']}: {val['chunked_ms']:.0f} "
                         f"vs {val['unchunked_ms']:.0f} ms unchunked ({val['overhead']:+.1%})")
        else:
            for r in val:
                lines.append(f"{name:<16} {r['model']:<12} N={r['lengths']}: " + ", ".join(
                    f"{k} {[round(p / GiB, 2) for p in v]} GiB" for k, v in r.items() if isinstance(v, list)
                    and k != "lengths"))
    return "\n".join(lines)
