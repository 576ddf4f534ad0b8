"""Where a step's time goes: a per-kernel breakdown of one denoising step (torch.profiler), with
the compute floor (FLOPs / measured bf16 matmul rate) and the byte floor beside it.

    python bench/profile_step.py --model llada-8b --tokens 8192 32768 --out $OUT

Kernels are grouped by what they do (attention, GEMM, elementwise/norm, logits reduction,
copies, other); each group's share of the step and the top kernels are written to JSON."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from common import canvas, free, median, record_header, timed

from mosaic import MosaicEngine, load

GROUPS = [("attention", r"flash|fmha|attention|attn|sdpa|cudnn"),
          ("gemm", r"gemm|cutlass|sm90_xmma|nvjet|cublas|matmul|ampere|hopper"),
          ("norm/rope/act (fused)", r"^_(square|scale|rope|silu_mul)_kernel"),
          ("masked logits (fused)", r"^_kernel$|^_uniform_kernel"),
          ("copy/index", r"copy|index|gather|scatter|fill|cat"),
          ("norm/rope/act (torch)", r"elementwise|vectorized|reduce|pow|rsqrt|mul|add|silu|sin|cos|mean")]


def group_of(name: str) -> str:
    for g, pat in GROUPS:
        if re.search(pat, name, re.I):
            return g
    return "other"


def matmul_rate() -> float:
    """Measured bf16 TFLOP/s of an 8192^3 torch.mm (random data), the compute ceiling."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = median(timed(lambda: torch.mm(a, b), repeat=10, warmup=3))
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def step_flops(cfg, n: int, m: int) -> dict:
    """FLOPs of one step: linear layers, attention (4 N^2 hd H per layer), masked logits."""
    d, L = cfg.hidden, cfg.num_layers
    per_tok = 2 * d * (cfg.q_dim + 2 * cfg.kv_dim) + 2 * cfg.q_dim * d
    if cfg.num_experts:  # top-k experts of 3 matrices each, plus the router
        per_tok += 2 * cfg.top_k * 3 * d * cfg.ffn + 2 * d * cfg.num_experts
    else:
        per_tok += 6 * d * cfg.ffn
    linear = L * n * per_tok
    attn = L * 4 * n * n * cfg.head_dim * cfg.num_heads
    logits = 2 * m * d * cfg.vocab
    return {"linear": linear, "attention": attn, "logits": logits, "total": linear + attn + logits}


def profile(engine, x, native: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile
    fn = lambda: engine.step(x, native=native)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t and ev.key:
            kernels[ev.key] = kernels.get(ev.key, 0.0) + t / 1e3
    groups: dict[str, float] = {}
    for k, ms in kernels.items():
        groups[group_of(k)] = groups.get(group_of(k), 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return {"kernel_ms_total": sum(kernels.values()), "groups_ms": groups,
            "top_kernels": [{"name": k[:160], "ms": v, "group": group_of(k)} for k, v in top]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llada-8b")
    ap.add_argument("--tokens", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rate = matmul_rate()
    rec = record_header(vars(args) | {"out": str(args.out)})
    rec["matmul_tflops"] = rate
    engine = MosaicEngine(load(args.model, device="cuda"), {"progress": False})
    cfg = engine.model.cfg
    rec["runs"] = []
    for n in args.tokens:
        x = canvas(engine.model, n, n // 2)
        fl = step_flops(cfg, n, n // 2)
        for native in (True, False):
            ms = median(timed(lambda native=native: engine.step(x, native=native), repeat=3))
            prof = profile(engine, x, native)
            r = {"tokens": n, "masked": n // 2, "path": "native" if native else "mosaic", "step_ms": ms,
                 "flops": fl, "compute_floor_ms": fl["total"] / (rate * 1e12) * 1e3, **prof}
            r["x_floor"] = ms / r["compute_floor_ms"]
            rec["runs"].append(r)
            (args.out / f"profile_{args.model}.json").write_text(json.dumps(rec, indent=1))
            free()
    print(f"matmul ceiling {rate:.0f} TFLOP/s")
    print(f"{'N':>7} {'path':>7} {'step ms':>9} {'floor ms':>9} {'x floor':>8}  groups (ms)")
    for r in rec["runs"]:
        g = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["groups_ms"].items(), key=lambda kv: -kv[1]))
        print(f"{r['tokens']:>7} {r['path']:>7} {r['step_ms']:>9.1f} {r['compute_floor_ms']:>9.1f} "
              f"{r['x_floor']:>8.2f}  {g}")


if __name__ == "__main__":
    main()
