"""Steps on the full presets: native 4k, exactness and latency, PAR, end to end, memory plot (GPU).

    python -m bench steps --out DIR [--quick] [--only steps e2e ...]

Sections (each recorded as soon as it is done; a failing one is recorded with its error):
  bundled_tokens  the bundled tiny-llada's tokens with the fused kernel on the GPU vs native
  native_4k       one native step of each full preset at N = 4096
  steps           masked-row logits exactness and step latency native vs Mosaic (and Mosaic with
                  cuDNN attention) at 8k / 32k, device peaks by the counters
  par             peak-to-average ratio of activation memory over one llada-8b step at 32k
  e2e             a whole 16-step llada-8b generation, native vs Mosaic, at 8k / 32k
  memory_plot     the GPU branch of `mosaic generate --memory-plot`: the first step of an 8k
                  request measured op by op on both paths beside the plan (PNG under --out)
--quick: small sizes, a smoke run."""

from __future__ import annotations

import json
import time

import torch

from bench.lib import engine as E
from bench.lib.exact import masked_logits_err
from bench.lib.measure import canvas, free, median, reset_peaks, timed
from mosaic import MosaicEngine, load

SECTIONS = ("bundled_tokens", "native_4k", "steps", "par", "e2e", "memory_plot")


def add_arguments(ap):
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--only", nargs="*", choices=SECTIONS, help="sections to run (default: all)")


def run_model(name: str, lengths, quick: bool) -> dict:
    out = {"model": name, "lengths": {}}
    model = load(name, device="cuda")
    engine = MosaicEngine(model, {"progress": False})
    out["weights_bytes"] = model.weight_bytes()
    for n in lengths:
        x = canvas(model, n, n // 2)
        rec = {"tokens": n, "masked": n // 2}
        rec["masked_logits_rel_err"] = masked_logits_err(engine, x)
        free()  # its full-logits block must not count in the native path's peak
        # mosaic_cudnn: Mosaic with the opt-in cuDNN attention, to show what that kernel is worth
        for path in ("native", "mosaic", "mosaic_cudnn"):
            E.set_attention(engine, "cudnn" if path == "mosaic_cudnn" else "sdpa")
            reset_peaks()
            ts = timed(E.step_fn(engine, x, native=path == "native"), repeat=2 if quick else 3)
            rec[f"{path}_step_ms"] = median(ts)
            rec[f"{path}_peak_bytes"] = E.counters_peak(engine)
            free()
        E.set_attention(engine, "sdpa")
        rec["latency_ratio"] = rec["mosaic_step_ms"] / rec["native_step_ms"]
        rec["latency_ratio_cudnn"] = rec["mosaic_cudnn_step_ms"] / rec["native_step_ms"]
        out["lengths"][n] = rec
        print(f"  {name} N={n}: native {rec['native_step_ms']:.0f} ms, mosaic {rec['mosaic_step_ms']:.0f} ms "
              f"(x{rec['latency_ratio']:.2f}; with cuDNN attention x{rec['latency_ratio_cudnn']:.2f}), "
              f"logits rel err {rec['masked_logits_rel_err']:.2e}", flush=True)
    del engine, model
    free()
    return out


def with_engine(name, fn):
    engine = MosaicEngine(load(name, device="cuda"), {"progress": False})
    try:
        return fn(engine)
    finally:
        del engine
        free()


def par(engine, n) -> dict:
    """Peak-to-average ratio of activation memory over one step (each op weighted by time)."""
    from mosaic.policy.timeline import Probe
    x = canvas(engine.model, n, n // 2)
    res = {"tokens": n}
    for path in ("native", "mosaic"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        extra = (lambda: E.arena_mapped_bytes(engine)) if path == "mosaic" else (lambda: 0)
        probe = Probe("cuda", extra)
        fn = E.step_fn(engine, x, native=path == "native", probe=probe)
        torch.cuda.reset_peak_memory_stats()
        fn()
        extra_peak = E.arena_mapped_bytes(engine) if path == "mosaic" and E.arena_kind(engine) == "vmm" else 0
        res[f"{path}_par"] = probe.par(base, torch.cuda.max_memory_allocated() + extra_peak)
        res[f"{path}_par_sampled_only"] = probe.par(base)
        res[f"{path}_samples"] = len(probe.samples)
    return res


def e2e(engine, n) -> dict:
    """A whole 16-step generation (prompt n/2, output n/2), native vs Mosaic."""
    prompt = torch.randint(0, 1000, (n // 2,)).tolist()
    res = {"tokens": n, "steps": 16}
    for native in (True, False):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.generate(prompt, max_new_tokens=n // 2, steps=16, native=native, progress=False)
        res["native_s" if native else "mosaic_s"] = time.perf_counter() - t0
        res["native_tokens" if native else "mosaic_tokens"] = out.tokens
    a, b = res.pop("native_tokens"), res.pop("mosaic_tokens")
    res["same_tokens"] = bool(torch.equal(a, b))
    res["token_agreement"] = float((a == b).float().mean())  # random weights: near-ties abound
    res["ratio"] = res["mosaic_s"] / res["native_s"]
    return res


def native_4k(name: str) -> dict:
    """One native step of the full preset at N = 4096 in bf16."""
    model = load(name, device="cuda")
    engine = MosaicEngine(model, {"progress": False})
    x = canvas(model, 4096, 2048)
    reset_peaks()
    ts = timed(E.step_fn(engine, x, native=True), repeat=3)
    rec = {"model": name, "tokens": 4096, "step_ms": median(ts), "peak_bytes": E.counters_peak(engine),
           "weights_bytes": model.weight_bytes()}
    del engine, model
    free()
    return rec


def bundled_tokens() -> dict:
    """The bundled model's tokens with the fused kernel on, on the GPU."""
    from mosaic.assets import tasks
    prompts = tasks.held_out(per_shape=10)
    res = {}
    for dtype in ("float32", "bfloat16"):
        engine = MosaicEngine("tiny-llada", {"device": "cuda", "dtype": dtype, "progress": False,
                                             "logits_kernel": "triton"})
        same = total = right = 0
        for n in sorted({len(p) for p in prompts}):
            group = [p for p in prompts if len(p) == n]
            a = engine.generate(group, native=True)
            b = engine.generate(group)
            same += int((a.tokens == b.tokens).all(1).sum())
            right += sum(t == tasks.solve(p) for p, t in zip(group, b.texts))
            total += len(group)
        fused = any(s.fused for s in E.history(engine))
        res[dtype] = {"prompts": total, "identical_to_native": same, "accuracy": right / total,
                      "fused_kernel_used": fused}
    return res


def memory_plot(out_dir, n: int = 8192, name: str = "llada-8b") -> dict:
    """The first step of a request (prompt N/2, N/2 masked) measured op by op on both paths,
    beside Mosaic's plan, full depth."""
    engine = MosaicEngine(load(name, device="cuda"), {"progress": False})
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, engine.model.cfg.mask_id - 1, (n // 2,), generator=g).tolist()
    gen = E.generation_config(engine, max_new_tokens=n // 2, steps=1)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"step_memory_gpu_{name}.png"
    series = E.memory_plot(engine, [prompt], gen, str(path))
    del engine
    free()
    return {"model": name, "tokens": n, "png": path.name,
            "series": {k: {"points": len(v), "peak_bytes": int(max(v)), "every_8th": [int(u) for u in v[::8]]}
                       for k, v in series.items()}}


def sections(quick: bool, out_dir) -> dict:
    return {
        "bundled_tokens": bundled_tokens,
        "native_4k": lambda: [native_4k(m) for m in ("llada-8b", "dream-7b", "llada-moe-7b")],
        "steps": lambda: [run_model(m, (2048,) if quick else (8192, 32768), quick) for m in ("llada-8b", "dream-7b")],
        "par": lambda: with_engine("llada-8b", lambda e: par(e, 4096 if quick else 32768)),
        "e2e": lambda: with_engine("llada-8b", lambda e: [e2e(e, n) for n in ((2048,) if quick else (8192, 32768))]),
        "memory_plot": lambda: memory_plot(out_dir, 2048 if quick else 8192),
    }


def run(args, rec) -> dict:
    for name, fn in sections(args.quick, args.out).items():
        if not args.only or name in args.only:
            rec.case(name, fn, into="sections")
            free()
    return rec


def table(rec) -> str:
    GiB = 2**30
    lines = []
    for name, val in rec.get("sections", {}).items():
        if isinstance(val, dict) and "error" in val:
            lines.append(f"{name:<16} ERROR {val['error'].splitlines()[-1][:100]}")
        elif name == "steps":
            for m in val:
                for n, r in m["lengths"].items():
                    lines.append(f"{'step':<16} {m['model']:<12} N={n:>7} native {r['native_step_ms']:8.0f} ms "
                                 f"{r['native_peak_bytes'] / GiB:6.1f} GiB | mosaic {r['mosaic_step_ms']:8.0f} ms "
                                 f"{r['mosaic_peak_bytes'] / GiB:6.1f} GiB | x{r['latency_ratio']:.2f} "
                                 f"err {r['masked_logits_rel_err']:.1e}")
        elif name == "memory_plot":
            lines.append(f"{'memory_plot':<16} " + ", ".join(f"{k}: {v['peak_bytes'] / GiB:.2f} GiB"
                                                          for k, v in val["series"].items()))
        else:
            lines.append(f"{name:<16} {json.dumps(val, default=str)[:150]}")
    lines.append("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in rec.get("seconds", {}).items()))
    return "\n".join(lines)
