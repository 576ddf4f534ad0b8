"""Where a step's device time goes: one step under torch.profiler, kernels grouped by what they do."""

from __future__ import annotations

import re

import torch

from . import engine as E

GROUPS = [("gemm split-K reduce", r"splitk|split_k"),
          ("attention", r"flash|fmha|attention|attn|sdpa|cudnn"),
          ("gemm", r"gemm|cutlass|sm90_xmma|nvjet|cublas|matmul|ampere|hopper"),
          ("norm/rope/act (fused)", r"^_\w*(square|scale|rope|silu)\w*_kernel|^_rmsnorm_rows"),
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
    fn = E.step_fn(engine, x, native=native)
    fn()
    torch.cuda.synchronize()
    return kernel_breakdown(fn, top=12)


def kernel_breakdown(fn, repeat: int = 1, top: int = 12) -> dict:
    """Device time of fn()'s kernels under torch.profiler (CUDA activities; a CUDA graph's replay
    reports each of its kernels), per call of fn (repeat calls averaged): total ms, launches,
    ms and launches per group (GROUPS) and the `top` kernels by time with their launch counts."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, list] = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t and ev.key:
            k = kernels.setdefault(ev.key, [0.0, 0])
            k[0] += t / 1e3 / repeat
            k[1] += ev.count / repeat
    groups: dict[str, float] = {}
    launches: dict[str, float] = {}
    for k, (ms, n) in kernels.items():
        groups[group_of(k)] = groups.get(group_of(k), 0.0) + ms
        launches[group_of(k)] = launches.get(group_of(k), 0) + n
    best = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {"kernel_ms_total": sum(v[0] for v in kernels.values()),
            "launches_total": sum(v[1] for v in kernels.values()), "groups_ms": groups, "groups_launches": launches,
            "top_kernels": [{"name": k[:160], "ms": v[0], "launches": v[1], "group": group_of(k)} for k, v in best]}
