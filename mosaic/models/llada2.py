"""LLaDA2.x (inclusionAI LLaDA2.0 / 2.1, LLaDA2MoeModelLM; BailingMoeV2-derived): a block
diffusion MoE. Fused q/k/v projection (split into q, k, v views of one tensor at load time),
per-head q/k RMSNorm, partial RoPE, the first `first_dense` layers dense FFNs, then MoE layers
with shared experts, a bias-corrected group-limited router (models/moe_grouped.py) and its
weights normalised and scaled as the config says. Keys under model.word_embeddings / model.layers
/ model.norm / lm_head. Source: docs/MODELS.md."""

from __future__ import annotations

from ..config import ModelConfig

FUSED = {"qkv": ("q", "k", "v"), "qkv_bias": ("q_bias", "k_bias", "v_bias")}   # split into views


def qkv_widths(cfg: ModelConfig) -> tuple[int, int, int]:
    return cfg.q_dim, cfg.kv_dim, cfg.kv_dim


def weight_keys(cfg: ModelConfig, tied: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Canonical key -> (checkpoint key, shape)."""
    d, F = cfg.hidden, cfg.ffn
    keys = {"embed": ("model.word_embeddings.weight", (cfg.vocab, d)), "final_norm": ("model.norm.weight", (d,))}
    if not tied:
        keys["lm_head"] = ("lm_head.weight", (cfg.vocab, d))
    qkv = sum(qkv_widths(cfg))
    for i in range(cfg.num_layers):
        p, c, a = f"model.layers.{i}.", f"layers.{i}.", f"model.layers.{i}.attention."
        keys |= {c + "attn_norm": (p + "input_layernorm.weight", (d,)),
                 c + "ffn_norm": (p + "post_attention_layernorm.weight", (d,)),
                 c + "qkv": (a + "query_key_value.weight", (qkv, d)),
                 c + "o": (a + "dense.weight", (d, cfg.q_dim))}
        if cfg.qkv_bias:
            keys[c + "qkv_bias"] = (a + "query_key_value.bias", (qkv,))
        if cfg.o_bias:
            keys[c + "o_bias"] = (a + "dense.bias", (d,))
        if cfg.qk_norm:
            keys[c + "q_norm"] = (a + "query_layernorm.weight", (cfg.head_dim,))
            keys[c + "k_norm"] = (a + "key_layernorm.weight", (cfg.head_dim,))
        m = p + "mlp."
        if i < cfg.first_dense:
            Fd = cfg.dense_ffn
            keys |= {c + "gate": (m + "gate_proj.weight", (Fd, d)), c + "up": (m + "up_proj.weight", (Fd, d)),
                     c + "down": (m + "down_proj.weight", (d, Fd))}
            continue
        keys[c + "router"] = (m + "gate.weight", (cfg.num_experts, d))
        keys[c + "router_bias"] = (m + "gate.expert_bias", (cfg.num_experts,))   # a buffer the class always has
        if cfg.shared_ffn:
            S = cfg.shared_ffn
            keys |= {c + "shared_gate": (m + "shared_experts.gate_proj.weight", (S, d)),
                     c + "shared_up": (m + "shared_experts.up_proj.weight", (S, d)),
                     c + "shared_down": (m + "shared_experts.down_proj.weight", (d, S))}
        for j in range(cfg.num_experts):
            e = f"{m}experts.{j}."
            keys[f"{c}experts_gate.{j}"] = (e + "gate_proj.weight", (F, d))
            keys[f"{c}experts_up.{j}"] = (e + "up_proj.weight", (F, d))
            keys[f"{c}experts_down.{j}"] = (e + "down_proj.weight", (d, F))
    return keys
