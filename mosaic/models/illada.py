"""iLLaDA (GSAI-ML/iLLaDA-8B, ILLaDAForCausalLM): LLaDA's full bidirectional attention with
Llama's checkpoint layout: grouped-query attention (32 query / 8 K/V heads at 8B), SwiGLU FFN,
RMSNorm, RoPE tables cast to the model dtype, and the LM head tied to the embedding. Sampling is
LLaDA's generate.py with mask id 5 (ML-GSAI/LLaDA README). Source: docs/MODELS.md."""

from __future__ import annotations

from ..config import ModelConfig
from .dream import attention_keys, outer_keys


def weight_keys(cfg: ModelConfig, tied: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Canonical key -> (checkpoint key, shape). tied: no lm_head.weight (tie_word_embeddings)."""
    d, F = cfg.hidden, cfg.ffn
    keys = outer_keys(cfg, tied)
    for i in range(cfg.num_layers):
        p, c = f"model.layers.{i}.", f"layers.{i}."
        keys |= {c + k: v for k, v in attention_keys(cfg, p, cfg.qkv_bias).items()}
        if cfg.o_bias:   # attention_bias: q, k, v and o all carry one
            keys[c + "o_bias"] = (p + "self_attn.o_proj.bias", (d,))
        keys |= {
            c + "gate": (p + "mlp.gate_proj.weight", (F, d)),
            c + "up": (p + "mlp.up_proj.weight", (F, d)),
            c + "down": (p + "mlp.down_proj.weight", (d, F)),
        }
    return keys
