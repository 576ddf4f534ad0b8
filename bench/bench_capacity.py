"""Issues 6 and 7: L_max predicted by the capacity planner and verified on the GPU; native and
ablation baselines; the depth check; chunking overhead.

Verification runs the capacity probe at the predicted L_max on a depth-truncated model that is
charged the full model's weight bytes (DESIGN.md section 5), and reads the device's own
counters: context + PyTorch's peak reserved + the arena's mapped peak + the missing weights."""

from __future__ import annotations

import time

import torch
from bench_memory import peak_counters
from common import canvas, free, median, reset_peaks, step_fns, timed

from mosaic import GenerationConfig, MosaicEngine, load
from mosaic.memory.accounting import context_bytes
from mosaic.policy.capacity import capacity_report

GiB = 2**30


def verify(name: str, budget: str, ratios=(1.0,), layers: int = 1) -> dict:
    model = load(name, device="cuda", num_layers=layers)
    engine = MosaicEngine(model, {"progress": False, "memory_budget": budget})
    # the prediction uses the engine's own accounting (context measured after loading, workspace
    # measured by its warm-up)
    rep = capacity_report(load(name, device="meta"), budget, context_bytes=engine.budget.context_bytes,
                          workspace_bytes=engine.budget.workspace_bytes)
    n = rep["l_max"]
    runs = []
    for r in ratios:
        m = max(1, round(0.5 * n * r))
        engine.admit(1, n, GenerationConfig(max_new_tokens=m))
        predicted = engine.last_admission.predicted_bytes
        x = canvas(model, n, m)
        reset_peaks()
        t0 = time.perf_counter()
        step_fns(engine, x, native=False)()
        torch.cuda.synchronize()
        measured = peak_counters(engine)
        h = engine.history[-1]
        runs.append({"mask_ratio": r, "masked": m, "chunks": list(h.chunks), "seconds": time.perf_counter() - t0,
                     "predicted_bytes": predicted, "measured_bytes": measured,
                     "prediction_error": (predicted - measured) / measured,
                     "within_budget": measured <= rep["budget_bytes"]})
        print(f"  {name} @ {budget}: N={n:,} M={m:,} chunks={h.chunks} measured {measured / GiB:.2f} GiB, "
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
        step_fns(engine, x, native=False)()
        reset_peaks()
        base = torch.cuda.memory_allocated()
        step_fns(engine, x, native=False)()
        torch.cuda.synchronize()
        act = torch.cuda.max_memory_allocated() - base + engine.arena.mapped_bytes * (engine.arena.kind == "vmm")
        out["full" if layers is None else "one_layer"] = {"activation_peak_bytes": act,
                                                          "plan_bytes": engine.history[-1].plan_bytes}
        del engine, model, x
        free()
    out["same"] = out["full"]["plan_bytes"] == out["one_layer"]["plan_bytes"]
    out["measured_rel_diff"] = abs(out["full"]["activation_peak_bytes"] - out["one_layer"]["activation_peak_bytes"]) \
        / out["full"]["activation_peak_bytes"]
    return out


def chunk_overhead(name="llada-8b", n=65536, layers=2) -> dict:
    """Step time with the chunk counts a tight budget forces vs unchunked, same N and M."""
    model = load(name, device="cuda", num_layers=layers)
    from mosaic.memory.accounting import FIXED_BYTES, input_bytes
    floor = 2 * (model.cfg.hidden + 2 * model.cfg.kv_dim) * n
    budget = model.weight_bytes() + context_bytes(torch.device("cuda")) + FIXED_BYTES + input_bytes(1, n) \
        + int(1.3 * floor)
    x = canvas(model, n, n // 2)
    res = {"model": name, "tokens": n, "layers": layers, "budget_bytes": budget}
    for label, conf in (("unchunked", {}), ("chunked", {"memory_budget": budget})):
        engine = MosaicEngine(model, {"progress": False, **conf})
        res[f"{label}_ms"] = median(timed(step_fns(engine, x, native=False), repeat=3))
        res[f"{label}_chunks"] = list(engine.history[-1].chunks)
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
            fn = step_fns_gen(engine, x, native, conf)
            reset_peaks()
            fn()
            torch.cuda.synchronize()
            peaks.append(peak_counters(engine))
            del engine, x, fn
            free()
        out[label] = peaks
    del model
    free()
    return out


def step_fns_gen(engine, x, native: bool, conf: str):
    """One native step with a given confidence dtype, or Mosaic's program (mask-only logits)
    run with PyTorch's allocator for every buffer: no arena, no chunking."""
    from mosaic.graph.ctx import EagerCtx
    from mosaic.models.layers import step_program
    from mosaic.models.step import make_step
    from mosaic.policy.probe import probe_step
    cfg = engine.model.cfg
    if native and cfg.family != "dream":
        return lambda: engine.step(x, native=True, config={"confidence_dtype": conf})
    if native:
        return step_fns(engine, x, native=True)

    def run():
        mask = (x == cfg.mask_id).reshape(-1)
        rows = mask.nonzero().squeeze(1)
        if cfg.logit_shift:
            rows = torch.where(rows % x.shape[1] == 0, rows, rows - 1)
        real = make_step(cfg, x, None, rows=rows,
                         reducer=probe_step(engine.model, x.shape[1], int(mask.sum())).reducer)
        return step_program(EagerCtx(engine.model.device, engine.model.dtype), engine.model, real)
    return run


def fit_lmax(lengths, peaks, budget_bytes) -> int:
    """Linear fit of peak(N) through the measured points, solved for the budget (multiple of 1024)."""
    n0, n1 = lengths[0], lengths[-1]
    slope = (peaks[-1] - peaks[0]) / (n1 - n0)
    base = peaks[0] - slope * n0
    return max(0, int((budget_bytes - base) / slope) // 1024 * 1024)
