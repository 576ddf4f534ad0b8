"""Steps on the full presets: native step at 4k (issue 2), masked-row logits exactness and step
latency native vs Mosaic at 8k / 32k (issue 3), PAR, end-to-end 16-step generation, and the
bundled model's tokens with the fused kernel on the GPU."""

from __future__ import annotations

import torch
from bench_memory import peak_counters
from common import canvas, free, median, reset_peaks, step_fns, timed

from mosaic import MosaicEngine, load
from mosaic.models.step import make_step


class Capture:
    """A reducer that keeps the masked rows' logits (the buffer path), for the exactness check."""

    def __init__(self, store):
        self.store, self.fused = store, None

    def outputs(self, dtype):
        return [("x0", torch.int64)]

    def signature(self):
        return ("capture",)

    def transient_bytes(self, m, V, dtype):
        return 0

    def __call__(self, lg, lu, a, b, outs):
        self.store[a:b] = lg.float()
        outs["x0"].copy_(lg.argmax(-1))


def masked_logits_err(engine, x) -> float:
    cfg = engine.model.cfg
    mask = (x == cfg.mask_id).reshape(-1)
    pos = mask.nonzero().squeeze(1)
    L = x.shape[1]
    rows = torch.where(pos % L == 0, pos, pos - 1) if cfg.logit_shift else pos
    full = engine.native_runner.forward(x, None).reshape(-1, cfg.vocab)[rows].float()
    store = torch.empty_like(full)
    step = make_step(engine.model.cfg, x, None, rows=rows, reducer=Capture(store))
    engine.runner.execute(step, engine.preparer.prepare(step))
    err = float((store - full).norm() / full.norm())
    del full, store
    return err


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
            engine.runner.attention = "cudnn" if path == "mosaic_cudnn" else "sdpa"
            fn = step_fns(engine, x, native=path == "native")
            reset_peaks()
            ts = timed(fn, repeat=2 if quick else 3)
            rec[f"{path}_step_ms"] = median(ts)
            rec[f"{path}_peak_bytes"] = peak_counters(engine)
            free()
        engine.runner.attention = "sdpa"
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
        extra = (lambda: engine.arena.mapped_bytes) if path == "mosaic" else (lambda: 0)
        probe = Probe("cuda", extra)
        fn = step_fns(engine, x, native=path == "native", probe=probe)
        torch.cuda.reset_peak_memory_stats()
        fn()
        extra_peak = engine.arena.mapped_bytes if path == "mosaic" and engine.arena.kind == "vmm" else 0
        res[f"{path}_par"] = probe.par(base, torch.cuda.max_memory_allocated() + extra_peak)
        res[f"{path}_par_sampled_only"] = probe.par(base)
        res[f"{path}_samples"] = len(probe.samples)
    return res


def e2e(engine, n) -> dict:
    """A whole 16-step generation (prompt n/2, output n/2), native vs Mosaic."""
    import time
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
    """Issue 2: one native step of the full preset at N = 4096 in bf16."""
    model = load(name, device="cuda")
    engine = MosaicEngine(model, {"progress": False})
    x = canvas(model, 4096, 2048)
    reset_peaks()
    ts = timed(step_fns(engine, x, native=True), repeat=3)
    rec = {"model": name, "tokens": 4096, "step_ms": median(ts), "peak_bytes": peak_counters(engine),
           "weights_bytes": model.weight_bytes()}
    del engine, model
    free()
    return rec


def bundled_tokens() -> dict:
    """Issue 4: the bundled model's tokens with the fused kernel on, on the GPU."""
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
        fused = any(s.fused for s in engine.history)
        res[dtype] = {"prompts": total, "identical_to_native": same, "accuracy": right / total,
                      "fused_kernel_used": fused}
    return res


def memory_plot(out_dir, n: int = 8192, name: str = "llada-8b") -> dict:
    """The GPU branch of `mosaic generate --memory-plot`: the first step of a request (prompt
    N/2, N/2 masked) measured op by op on both paths, beside Mosaic's plan, full depth."""
    from pathlib import Path

    engine = MosaicEngine(load(name, device="cuda"), {"progress": False})
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, engine.model.cfg.mask_id - 1, (n // 2,), generator=g).tolist()
    gen = engine.generation_config(None, max_new_tokens=n // 2, steps=1)
    path = Path(out_dir) / f"step_memory_gpu_{name}.png"
    series = engine.memory_plot([prompt], gen, str(path))
    del engine
    free()
    return {"model": name, "tokens": n, "png": path.name,
            "series": {k: {"points": len(v), "peak_bytes": int(max(v)), "every_8th": [int(u) for u in v[::8]]}
                       for k, v in series.items()}}
