"""Where a step's device time goes: one step under torch.profiler, kernels grouped by what they do."""

from __future__ import annotations

import re

import torch

from . import engine as E

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


def profile(engine, x: torch.Tensor, native: bool) -> dict:
    """Device ms per kernel group and the top 12 kernels of one step (after one warm-up step)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    fn = E.step_fn(engine, x, native=native)
    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
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
