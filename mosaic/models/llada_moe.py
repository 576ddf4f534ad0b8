"""LLaDA-MoE (OLMoE-derived): per-head RMSNorm on q and k before RoPE, every layer a mixture of
num_experts routed experts (top-k, no renormalisation, no shared expert). Sampling as LLaDA.

Experts are stacked per layer ([E, F, d]) at load time, one expert tensor at a time."""

from __future__ import annotations

from ..config import ModelConfig
from .dream import attention_keys, outer_keys


def weight_keys(cfg: ModelConfig, tied: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    d, F, hd = cfg.hidden, cfg.ffn, cfg.head_dim
    keys = outer_keys(cfg, tied)
    for i in range(cfg.num_layers):
        p, c = f"model.layers.{i}.", f"layers.{i}."
        keys |= {c + k: v for k, v in attention_keys(cfg, p, cfg.qkv_bias).items()}
        if cfg.qk_norm:  # qk_layernorm: false builds the attention without them, as published
            keys[c + "q_norm"] = (p + "self_attn.q_norm.weight", (hd,))
            keys[c + "k_norm"] = (p + "self_attn.k_norm.weight", (hd,))
        keys[c + "router"] = (p + "mlp.gate.weight", (cfg.num_experts, d))
        for j in range(cfg.num_experts):
            e = f"{p}mlp.experts.{j}."
            keys[f"{c}experts_gate.{j}"] = (e + "gate_proj.weight", (F, d))
            keys[f"{c}experts_up.{j}"] = (e + "up_proj.weight", (F, d))
            keys[f"{c}experts_down.{j}"] = (e + "down_proj.weight", (d, F))
    return keys
