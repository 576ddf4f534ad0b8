"""Dream: Qwen2 geometry (grouped-query attention, q/k/v biases), RoPE in the model dtype, and the
logit shift: masked position j is predicted from hidden state j-1 (position 0 from itself)."""

from __future__ import annotations

from ..config import ModelConfig


def attention_keys(cfg: ModelConfig, prefix: str, bias: bool) -> dict[str, tuple[str, tuple]]:
    a, d = prefix + "self_attn.", cfg.hidden
    keys = {
        "q": (a + "q_proj.weight", (cfg.q_dim, d)),
        "k": (a + "k_proj.weight", (cfg.kv_dim, d)),
        "v": (a + "v_proj.weight", (cfg.kv_dim, d)),
        "o": (a + "o_proj.weight", (d, cfg.q_dim)),
        "attn_norm": (prefix + "input_layernorm.weight", (d,)),
        "ffn_norm": (prefix + "post_attention_layernorm.weight", (d,)),
    }
    if bias:
        for n, width in (("q", cfg.q_dim), ("k", cfg.kv_dim), ("v", cfg.kv_dim)):
            keys[n + "_bias"] = (a + f"{n}_proj.bias", (width,))
    return keys


def outer_keys(cfg: ModelConfig, tied: bool) -> dict[str, tuple[str, tuple]]:
    keys = {"embed": ("model.embed_tokens.weight", (cfg.vocab, cfg.hidden)),
            "final_norm": ("model.norm.weight", (cfg.hidden,))}
    if not tied:
        keys["lm_head"] = ("lm_head.weight", (cfg.vocab, cfg.hidden))
    return keys


def weight_keys(cfg: ModelConfig, tied: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    d, F = cfg.hidden, cfg.ffn
    keys = outer_keys(cfg, tied)
    for i in range(cfg.num_layers):
        p, c = f"model.layers.{i}.", f"layers.{i}."
        keys |= {c + k: v for k, v in attention_keys(cfg, p, cfg.qkv_bias).items()}
        keys |= {
            c + "gate": (p + "mlp.gate_proj.weight", (F, d)),
            c + "up": (p + "mlp.up_proj.weight", (F, d)),
            c + "down": (p + "mlp.down_proj.weight", (d, F)),
        }
    return keys
