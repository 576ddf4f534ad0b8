"""LLaDA (dense): plain multi-head attention, no biases, RoPE applied in fp32, separate LM head.

Checkpoint keys under model.transformer.; the block's down projection and the LM head share the
leaf name ff_out."""

from __future__ import annotations

from ..config import ModelConfig


def weight_keys(cfg: ModelConfig, tied: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    d, F, V = cfg.hidden, cfg.ffn, cfg.vocab
    p = "model.transformer."
    keys = {"embed": (p + "wte.weight", (V, d)), "final_norm": (p + "ln_f.weight", (d,))}
    if not tied:
        keys["lm_head"] = (p + "ff_out.weight", (V, d))
    for i in range(cfg.num_layers):
        b, c = f"{p}blocks.{i}.", f"layers.{i}."
        keys |= {
            c + "attn_norm": (b + "attn_norm.weight", (d,)),
            c + "q": (b + "q_proj.weight", (cfg.q_dim, d)),
            c + "k": (b + "k_proj.weight", (cfg.kv_dim, d)),
            c + "v": (b + "v_proj.weight", (cfg.kv_dim, d)),
            c + "o": (b + "attn_out.weight", (d, cfg.q_dim)),
            c + "ffn_norm": (b + "ff_norm.weight", (d,)),
            c + "gate": (b + "ff_proj.weight", (F, d)),
            c + "up": (b + "up_proj.weight", (F, d)),
            c + "down": (b + "ff_out.weight", (d, F)),
        }
        if cfg.qkv_bias:
            for n, width in (("q", cfg.q_dim), ("k", cfg.kv_dim), ("v", cfg.kv_dim)):
                keys[c + n + "_bias"] = (b + f"{n}_proj.bias", (width,))
    return keys
