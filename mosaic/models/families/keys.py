"""Checkpoint-key layouts several families share (canonical name -> (checkpoint key, shape)):
the Llama / Qwen layout (model.embed_tokens, model.layers.N.self_attn.*, mlp.*, model.norm,
lm_head) and its pieces. A family record composes its keys from these or writes its own."""

from __future__ import annotations

from ...config import ModelConfig
from .base import Keys


def attention_keys(cfg: ModelConfig, prefix: str, bias: bool) -> Keys:
    """self_attn.{q,k,v,o}_proj (+ q/k/v biases), input_layernorm, post_attention_layernorm."""
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


def qk_norm_keys(cfg: ModelConfig, prefix: str) -> Keys:
    """Per-head q and k RMSNorm weights over head_dim (self_attn.q_norm / k_norm)."""
    return {"q_norm": (prefix + "self_attn.q_norm.weight", (cfg.head_dim,)),
            "k_norm": (prefix + "self_attn.k_norm.weight", (cfg.head_dim,))}


def mlp_keys(cfg: ModelConfig, prefix: str, width: int | None = None) -> Keys:
    """A dense SwiGLU FFN: mlp.{gate,up,down}_proj of `width` columns (default cfg.ffn)."""
    d, F, m = cfg.hidden, width or cfg.ffn, prefix + "mlp."
    return {"gate": (m + "gate_proj.weight", (F, d)), "up": (m + "up_proj.weight", (F, d)),
            "down": (m + "down_proj.weight", (d, F))}


def expert_keys(cfg: ModelConfig, prefix: str) -> Keys:
    """Routed experts J (stacked [E, ...] per layer at load time): <prefix>experts.J.*_proj."""
    d, F, keys = cfg.hidden, cfg.ffn, {}
    for j in range(cfg.num_experts):
        e = f"{prefix}experts.{j}."
        keys[f"experts_gate.{j}"] = (e + "gate_proj.weight", (F, d))
        keys[f"experts_up.{j}"] = (e + "up_proj.weight", (F, d))
        keys[f"experts_down.{j}"] = (e + "down_proj.weight", (d, F))
    return keys


def outer_keys(cfg: ModelConfig, tied: bool) -> Keys:
    """model.embed_tokens, model.norm and (untied) lm_head."""
    keys = {"embed": ("model.embed_tokens.weight", (cfg.vocab, cfg.hidden)),
            "final_norm": ("model.norm.weight", (cfg.hidden,))}
    if not tied:
        keys["lm_head"] = ("lm_head.weight", (cfg.vocab, cfg.hidden))
    return keys


def layered(cfg: ModelConfig, tied: bool, layer_keys) -> Keys:
    """outer_keys + for each layer i, layer_keys(i, 'model.layers.i.') under 'layers.i.'."""
    keys = outer_keys(cfg, tied)
    for i in range(cfg.num_layers):
        keys |= {f"layers.{i}.{k}": v for k, v in layer_keys(i, f"model.layers.{i}.").items()}
    return keys
