"""Floors a measured time is compared with: the device's matrix rate and copy bandwidth measured in
the same run, and the FLOPs of a step (docs/BENCHMARKS.md, "compute floor")."""

from __future__ import annotations

import torch

from .measure import cuda_ms, median, timed


def matmul_rate(n: int = 8192, device: str = "cuda") -> float:
    """Measured bf16 TFLOP/s of an n^3 torch.mm on random data (median of 10 after 3 warm-ups):
    the compute ceiling (~700-790 on an H200)."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    ms = median(timed(lambda: torch.mm(a, b), repeat=10, warmup=3))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def copy_rate(dst: torch.Tensor, src: torch.Tensor, reps: int = 5) -> float:
    """GB/s (1e9 bytes) of dst.copy_(src, non_blocking=True) by CUDA events (pinned host memory
    for host <-> device copies)."""
    ms = cuda_ms(lambda: dst.copy_(src, non_blocking=True), reps)
    return src.numel() * src.element_size() / ms / 1e6


def pcie(nbytes: int = 2**30, reps: int = 5) -> dict:
    """Pinned host <-> device copy rates of nbytes, GB/s each way."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return {"bytes": nbytes, "h2d_GBps": copy_rate(dev, host, reps), "d2h_GBps": copy_rate(host, dev, reps)}


def step_flops(cfg, n: int, m: int) -> dict:
    """FLOPs of one denoising step of n tokens with m masked: linear layers 2·n·(weights per
    layer)·layers (top-k experts of 3 matrices each plus the router for MoE), attention
    4·n²·head_dim·heads·layers, masked logits 2·m·d·V. Softmax and elementwise work are not
    counted, so the floor is a true lower bound."""
    d, L = cfg.hidden, cfg.num_layers
    per_tok = 2 * d * (cfg.q_dim + 2 * cfg.kv_dim) + 2 * cfg.q_dim * d
    if cfg.num_experts:
        per_tok += 2 * cfg.top_k * 3 * d * cfg.ffn + 2 * d * cfg.num_experts
    else:
        per_tok += 6 * d * cfg.ffn
    linear = L * n * per_tok
    attn = L * 4 * n * n * cfg.head_dim * cfg.num_heads
    logits = 2 * m * d * cfg.vocab
    return {"linear": linear, "attention": attn, "logits": logits, "total": linear + attn + logits}


def floor_ms(flops: dict, tflops: float) -> float:
    """The compute floor of a step in ms: its FLOPs at the measured matrix rate."""
    return flops["total"] / (tflops * 1e12) * 1e3


def step_read_bytes(model, batch: int, keys: int, experts_per_layer: float | None = None) -> dict:
    """Bytes one step must read at least (the byte floor), by part: every layer weight and the
    LM head and final norm (the embedding's table only when it is the LM head: a step reads just
    its rows), of a MoE layer's routed experts only the `experts_per_layer` its rows reach (mean
    over the MoE layers, measured by routing; None: all of them), and the K and V its queries
    attend: batch x keys x 2 x kv_dim x layers. Bytes of what the step writes (its block's K/V,
    activations) are not counted: the floor is a lower bound."""
    cfg, seen = model.cfg, set()
    dense = expert = moe_layers = 0

    def nbytes(t):
        if id(t) in seen:
            return 0
        seen.add(id(t))
        return t.numel() * t.element_size()

    for t in (model.final_norm, model.lm_head):
        dense += nbytes(t)
    for lw in model.layers:
        ex = {k: t for k, t in lw.items() if k.startswith("experts_")}
        dense += sum(nbytes(t) for k, t in lw.items() if k not in ex)
        if ex:
            moe_layers += 1
            held = next(iter(ex.values())).shape[0]
            one = sum(t.numel() * t.element_size() for t in ex.values()) // held
            expert += one * (held if experts_per_layer is None else min(held, experts_per_layer))
    kv = batch * keys * 2 * cfg.kv_dim * len(model.layers) * model.dtype.itemsize
    return {"weights": dense, "experts": int(expert), "kv": kv, "total": dense + int(expert) + kv,
            "moe_layers": moe_layers}
