"""iLLaDA (GSAI-ML/iLLaDA-8B, ILLaDAForCausalLM): LLaDA's full bidirectional attention with
Llama's checkpoint layout: grouped-query attention (32 query / 8 K/V heads at 8B), SwiGLU FFN,
RMSNorm, RoPE tables cast to the model dtype, and the LM head tied to the embedding. Sampling is
LLaDA's generate.py with mask id 5 (ML-GSAI/LLaDA README), so mosaic.compat.generate serves it.
Source: docs/MODELS.md."""

from __future__ import annotations

from ...checkpoint_fields import COMMON, NONE, OFF, is_, special_ids
from ...config import ModelConfig
from ...config.hf_read import checked, get, head_size, need, theta
from .base import Family
from .dream import common_hf
from .keys import attention_keys, layered, mlp_keys
from .llada import SAMPLERS, WARMUP_CASES

# iLLaDA's config.json names no mask id: <[MASK]> is token 5 (ML-GSAI/LLaDA README: mask_id=5), EOS 2
DEFAULT_IDS = {"mask_token_id": 5, "eos_token_id": 2, "bos_token_id": None, "eot_token_id": None,
               "pad_token_id": None}
REFUSED = {
    "hidden_act": (is_(None, "silu"), "'silu'", "only the SwiGLU (silu) feed-forward is implemented"),
    "layer_norm_eps": (NONE, "null", "LayerNorm blocks are not implemented (RMSNorm is)"),
    "mlp_bias": (OFF, "false", "feed-forward biases are not implemented"),
    **COMMON,
}
IMPLEMENTED = frozenset({
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "rope_theta", "rope_parameters", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias"})


def parse(raw: dict) -> ModelConfig:
    """Llama-style names and keys, GQA, head size hidden / heads (the published attention ignores
    head_dim), RoPE tables cast to the model dtype, tied head."""
    d, heads = need(raw, "hidden_size"), need(raw, "num_attention_heads")
    hd = head_size(raw, d, heads, "iLLaDA")
    vocab = need(raw, "vocab_size")
    return checked(ModelConfig(
        family="illada", hidden=d, num_layers=need(raw, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=get(raw, "num_key_value_heads", heads), head_dim=hd,
        ffn=need(raw, "intermediate_size"), vocab=vocab, rope_theta=theta(raw, 10000.0),
        rms_eps=get(raw, "rms_norm_eps", 1e-6), **special_ids(raw, DEFAULT_IDS, vocab), rope_fp32=False,
        qkv_bias=bool(raw.get("attention_bias", False)), o_bias=bool(raw.get("attention_bias", False)),
        tied=bool(raw.get("tie_word_embeddings", True)), max_seq_len=get(raw, "max_position_embeddings", 8192)))


def to_hf(cfg: ModelConfig) -> dict:
    return {**common_hf(cfg), "model_type": "illada", "architectures": ["ILLaDAForCausalLM"],
            "intermediate_size": cfg.ffn, "tie_word_embeddings": cfg.tied, "attention_bias": cfg.qkv_bias,
            "mlp_bias": False, "hidden_act": "silu", "layer_norm_eps": None}


def layer_keys(cfg: ModelConfig, p: str) -> dict:
    keys = attention_keys(cfg, p, cfg.qkv_bias)
    if cfg.o_bias:   # attention_bias: q, k, v and o all carry one
        keys["o_bias"] = (p + "self_attn.o_proj.bias", (cfg.hidden,))
    return keys | mlp_keys(cfg, p)


def weight_keys(cfg: ModelConfig, tied: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Canonical key -> (checkpoint key, shape). tied: no lm_head.weight (tie_word_embeddings)."""
    return layered(cfg, tied, lambda i, p: layer_keys(cfg, p))


PRESETS = {
    # GSAI-ML/iLLaDA-8B model card (layers, width, heads, FFN, vocabulary, context, tied head) and
    # modeling_illada.py (head size = hidden / heads, RoPE tables in the model dtype); rope_theta and
    # rms_norm_eps are not in any file read (the config.json was not available): they change no
    # byte count and no step's cost (docs/MODELS.md)
    "illada-8b": ModelConfig(
        family="illada", hidden=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        ffn=14336, vocab=155136, rope_theta=500000.0, rms_eps=1e-6, mask_id=5, eos_id=2,
        rope_fp32=False, tied=True, max_seq_len=8192),
}

FAMILY = Family(
    name="illada", display="iLLaDA", model_types=("illada",), parse=parse, to_hf=to_hf, weight_keys=weight_keys,
    refused=REFUSED, implemented=IMPLEMENTED, presets=PRESETS, samplers=SAMPLERS, tensor_parallel=True,
    warmup_cases=WARMUP_CASES, published_call="llada.generate")
