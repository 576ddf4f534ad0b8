"""Step speed, exact path vs native vs options, beside the compute floor (GPU).

    python -m bench speed --out DIR            # H200: ~5 minutes

Per model (full-depth presets) at 8k and 32k tokens (prompt N/2, N/2 masked): one step of
  native            the published forward + sampler (PyTorch ops, SDPA in PyTorch's order)
  exact             Mosaic's planned path with its defaults (fused elementwise kernels)
  exact-torch-ew    the same with PyTorch's elementwise op chains (the previous default)
  cudnn             attention='cudnn' forced (opt-in)
with the masked rows' logits of `exact` against native (relative error; 0 = bit for bit), the
step's candidates and confidences compared, and the per-kernel-group time of `exact`. Then the
llada-8b step at its 20 GiB L_max, full depth, with min_attention_rows 0 and 1024, and the
device memory peak sampled by NVML during each. Compute floor = step FLOPs / measured matmul rate.
"""

from __future__ import annotations

import time

import torch

from bench.lib import engine as E
from bench.lib.exact import masked_logits_err
from bench.lib.floors import floor_ms, matmul_rate, step_flops
from bench.lib.measure import canvas, free, median, meter, timed
from bench.lib.profiler import profile
from mosaic import MosaicEngine, load
from mosaic.memory.accounting import context_bytes
from mosaic.policy.capacity import capacity_report

PATHS = {"exact": {}, "exact-torch-ew": {"elementwise_kernel": "torch"}, "cudnn": {"attention": "cudnn"}}


def add_arguments(ap):
    ap.add_argument("--models", nargs="*", default=["llada-8b", "dream-7b"])
    ap.add_argument("--tokens", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--lmax-budget", default="20GiB")
    ap.add_argument("--lmax-rows", type=int, nargs="*", default=[0, 1024])


def model_runs(name: str, lengths, rate: float) -> list[dict]:
    model = load(name, device="cuda")
    engines = {"native": MosaicEngine(model, {"progress": False})}
    engines |= {p: MosaicEngine(model, {"progress": False, **kw}) for p, kw in PATHS.items()}
    out = []
    for n in lengths:
        x = canvas(model, n, n // 2)
        rec = {"model": name, "tokens": n, "masked": n // 2, "flops": step_flops(model.cfg, n, n // 2)}
        rec["compute_floor_ms"] = floor_ms(rec["flops"], rate)
        try:
            rec["masked_logits_rel_err"] = masked_logits_err(engines["exact"], x)
            free()
            a = E.step(engines["native"], x, native=True)
            b = E.step(engines["exact"], x)
            rec["same_candidates"] = bool(torch.equal(a[0], b[0]))
            rec["same_confidences"] = bool(torch.equal(a[1], b[1]))
            del a, b
            free()
        except Exception as e:  # noqa: BLE001
            rec["exactness_error"] = repr(e)[:300]
        for path, eng in engines.items():
            try:
                rec[f"{path}_ms"] = median(timed(E.step_fn(eng, x, native=path == "native"), repeat=3))
            except Exception as e:  # noqa: BLE001
                rec[f"{path}_error"] = repr(e)[:300]
            free()
        if "exact_ms" in rec and "native_ms" in rec:
            for path in PATHS:
                if f"{path}_ms" in rec:
                    rec[f"{path}_vs_native"] = rec[f"{path}_ms"] / rec["native_ms"]
            rec["floor_vs_native"] = rec["compute_floor_ms"] / rec["native_ms"]
            rec["exact_x_floor"] = rec["exact_ms"] / rec["compute_floor_ms"]
        try:
            rec["exact_profile"] = profile(engines["exact"], x, native=False)
        except Exception as e:  # noqa: BLE001
            rec["profile_error"] = repr(e)[:300]
        out.append(rec)
        print(f"  {name} N={n}: native {rec.get('native_ms', 0):.0f} exact {rec.get('exact_ms', 0):.0f} "
              f"torch-ew {rec.get('exact-torch-ew_ms', 0):.0f} cudnn {rec.get('cudnn_ms', 0):.0f} ms; "
              f"floor {rec['compute_floor_ms']:.0f}; logits err {rec.get('masked_logits_rel_err')}", flush=True)
        free()
    del engines, model
    free()
    return out


def lmax_runs(budget: str, rows_list, rate: float) -> list[dict]:
    model = load("llada-8b", device="cuda")
    out = []
    for rows in rows_list:
        engine = MosaicEngine(model, {"progress": False, "memory_budget": budget, "min_attention_rows": rows})
        ctx = context_bytes(model.device)
        rep = capacity_report(load("llada-8b", device="meta"), budget, context_bytes=ctx, ratios=(1.0,),
                              min_attention_rows=rows)
        n = rep["l_max"]
        x = canvas(model, n, n // 2)
        rec = {"budget": budget, "min_attention_rows": rows, "tokens": n, "masked": n // 2,
               "context_bytes": ctx, "flops": step_flops(model.cfg, n, n // 2)}
        rec["compute_floor_ms"] = floor_ms(rec["flops"], rate)
        try:
            adm = E.admit(engine, 1, n, E.generation_config(engine, max_new_tokens=n // 2))
            rec["predicted_bytes"] = adm.predicted_bytes
            rec["chunks"] = list(adm.chunks)
            torch.cuda.synchronize()
            with meter(mode="device") as m, m.window() as w:   # the whole device, driver included
                t0 = time.perf_counter()
                E.step(engine, x)
                torch.cuda.synchronize()
                rec["step_ms"] = (time.perf_counter() - t0) * 1e3
            rec["nvml_peak_used_bytes"], rec["nvml_before_bytes"] = w.peak_bytes, w.start_bytes
            rec["x_floor"] = rec["step_ms"] / rec["compute_floor_ms"]
        except Exception as e:  # noqa: BLE001
            rec["error"] = repr(e)[:500]
        out.append(rec)
        print(f"  L_max {budget} rows>={rows}: N={n:,} step {rec.get('step_ms', 0) / 1e3:.1f} s, floor "
              f"{rec['compute_floor_ms'] / 1e3:.1f} s (x{rec.get('x_floor', 0):.2f}), chunks {rec.get('chunks')}",
              flush=True)
        del engine, x
        free()
    return out


def run(args, rec) -> dict:
    rec["matmul_tflops"] = rate = matmul_rate()
    rec["runs"] = []
    for name in args.models:
        rec["runs"] += model_runs(name, args.tokens, rate)
        rec.save()
    rec["lmax"] = lmax_runs(args.lmax_budget, args.lmax_rows, rate) if args.lmax_rows else []
    return rec


def table(rec) -> str:
    lines = [f"matmul ceiling {rec['matmul_tflops']:.0f} TFLOP/s",
             f"{'model':<10} {'N':>6} {'native':>8} {'exact':>8} {'x nat':>6} {'torch-ew':>9} {'cudnn':>8} "
             f"{'floor':>7} {'floor/nat':>9} {'logits err':>10} {'same':>5}"]
    for r in rec["runs"]:
        lines.append(f"{r['model']:<10} {r['tokens']:>6} {r.get('native_ms', 0):>8.1f} {r.get('exact_ms', 0):>8.1f} "
                     f"{r.get('exact_vs_native', 0):>6.3f} {r.get('exact-torch-ew_ms', 0):>9.1f} "
                     f"{r.get('cudnn_ms', 0):>8.1f} {r['compute_floor_ms']:>7.1f} {r.get('floor_vs_native', 0):>9.3f} "
                     f"{r.get('masked_logits_rel_err', -1):>10.2e} {str(r.get('same_candidates')):>5}")
    for r in rec["lmax"]:
        lines.append(f"L_max {r['budget']} rows>={r['min_attention_rows']}: N={r['tokens']:,} step "
                     f"{r.get('step_ms', 0) / 1e3:.1f} s, floor {r['compute_floor_ms'] / 1e3:.1f} s, "
                     f"x{r.get('x_floor', 0):.2f}, NVML peak {r.get('nvml_peak_used_bytes', 0) / 2**30:.2f} GiB "
                     f"(predicted {r.get('predicted_bytes', 0) / 2**30:.2f})")
    return "\n".join(lines)
