"""LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B, OLMoE-derived configuration_lladamoe.py /
modeling_lladamoe.py): per-head RMSNorm on q and k before RoPE, every layer a mixture of
num_experts routed experts (softmax in fp32, top-k, no renormalisation, expert outputs summed in
expert-id order, no shared expert). Samples as LLaDA. Experts are stacked per layer ([E, F, d])
at load time. Source: docs/MODELS.md."""

from __future__ import annotations

from ...checkpoint_fields import COMMON, NONE, OFF, ONE, is_, special_ids
from ...config import ModelConfig
from ...config.hf_read import checked, get, head_size, need, theta, trained_length
from .base import Family
from .dream import common_hf
from .keys import attention_keys, expert_keys, layered, qk_norm_keys
from .llada import IS_MOE, SAMPLERS, WARMUP_CASES

DEFAULT_IDS = {"mask_token_id": 156895, "eos_token_id": 156892, "bos_token_id": None,
               "eot_token_id": None, "pad_token_id": None}
_ALL_MOE = lambda v: v in (None, 1) or (isinstance(v, list) and all(f == 1 for f in v))  # noqa: E731
REFUSED = {
    "hidden_act": (is_(None, "silu"), "'silu'", "only the SwiGLU (silu) experts are implemented"),
    "attention_bias": (OFF, "false", "attention biases are not implemented for LLaDA-MoE"),
    "clip_qkv": (NONE, "null", "q/k/v clipping is not implemented"),
    "shared_expert_intermediate_size": (OFF, "null", "shared experts are not implemented"),
    "num_shared_experts": (OFF, "0", "shared experts are not implemented"),
    "moe_layer_freq": (_ALL_MOE, "every layer a MoE layer (all 1)", "dense layers are not implemented"),
    "moe_router_enable_expert_bias": (OFF, "false", "router expert biases are not implemented"),
    # the published block always applies softmax, never renormalises the top-k weights and never
    # scales them, whatever these fields say: a checkpoint that sets them asks for math the
    # reference does not run, so which one it was trained with is unknown
    "moe_router_score_function": (is_(None, "softmax"), "'softmax'",
                                  "the published LLaDA-MoE router always uses softmax"),
    "norm_topk_prob": (OFF, "false", "the published LLaDA-MoE code never renormalises the top-k "
                                     "router weights (it ignores this field)"),
    "routed_scaling_factor": (ONE, "1", "the published LLaDA-MoE code never scales expert outputs"),
    "router_num_group": (lambda v: v is None or v in (-2, 0, 1), "null", "grouped expert routing is not implemented"),
    "router_topk_group": (lambda v: v is None or v in (-2, 0, 1), "null", "grouped expert routing is not implemented"),
    **COMMON,
}
IMPLEMENTED = frozenset({
    "hidden_size", "d_model", "num_hidden_layers", "n_layers", "num_attention_heads", "n_heads",
    "num_key_value_heads", "head_dim", "expert_intermediate_size", "moe_intermediate_size", "vocab_size",
    "embedding_size", "rope_theta", "rope_parameters", "rms_norm_eps", "max_position_embeddings",
    "partial_rotary_factor", "qk_layernorm", "qkv_bias", "num_experts", "moe_num_experts", "n_routed_experts",
    "num_experts_per_tok", "moe_top_k", "top_k", "tie_word_embeddings"})


def parse(raw: dict) -> ModelConfig:
    d = need(raw, "hidden_size", "d_model")
    heads = need(raw, "num_attention_heads", "n_heads")
    hd = head_size(raw, d, heads, "LLaDA-MoE")   # the published attention always uses hidden / heads
    vocab = need(raw, "vocab_size", "embedding_size")
    return checked(ModelConfig(
        family="llada_moe", hidden=d, num_layers=need(raw, "num_hidden_layers", "n_layers"),
        num_heads=heads, num_kv_heads=get(raw, "num_key_value_heads", heads), head_dim=hd,
        ffn=need(raw, "expert_intermediate_size", "moe_intermediate_size", "intermediate_size"),
        vocab=vocab, rope_theta=theta(raw, 50000.0), rms_eps=get(raw, "rms_norm_eps", 1e-5),
        **special_ids(raw, DEFAULT_IDS, vocab),
        rotary_dim=int(hd * get(raw, "partial_rotary_factor", 1.0)), rope_fp32=False,
        qkv_bias=bool(raw.get("qkv_bias", False)), qk_norm=bool(raw.get("qk_layernorm", True)),
        num_experts=need(raw, *IS_MOE), top_k=need(raw, "num_experts_per_tok", "moe_top_k", "top_k"),
        max_seq_len=trained_length(raw, 4096)))


def to_hf(cfg: ModelConfig) -> dict:
    return {"model_type": "llada", "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
            "expert_intermediate_size": cfg.ffn, "partial_rotary_factor": cfg.rot_dim / cfg.head_dim,
            "qk_layernorm": cfg.qk_norm, "qkv_bias": cfg.qkv_bias, "norm_topk_prob": False,
            "moe_layer_freq": [1] * cfg.num_layers, **common_hf(cfg)}


def layer_keys(cfg: ModelConfig, p: str) -> dict:
    keys = attention_keys(cfg, p, cfg.qkv_bias)
    if cfg.qk_norm:  # qk_layernorm: false builds the attention without them, as published
        keys |= qk_norm_keys(cfg, p)
    keys["router"] = (p + "mlp.gate.weight", (cfg.num_experts, cfg.hidden))
    return keys | expert_keys(cfg, p + "mlp.")


def weight_keys(cfg: ModelConfig, tied: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    return layered(cfg, tied, lambda i, p: layer_keys(cfg, p))


PRESETS = {
    "llada-moe-7b": ModelConfig(
        family="llada_moe", hidden=2048, num_layers=16, num_heads=16, num_kv_heads=16,
        head_dim=128, ffn=1024, vocab=157184, rope_theta=50000.0, rms_eps=1e-5, mask_id=156895,
        eos_id=156892, rope_fp32=False, qk_norm=True, num_experts=64, top_k=8),
}

FAMILY = Family(
    name="llada_moe", display="LLaDA-MoE", model_types=("llada", "lladamoe", "llada_moe"),
    claims=lambda raw: str(raw.get("model_type", "")).lower() != "llada" or any(k in raw for k in IS_MOE),
    parse=parse, to_hf=to_hf, weight_keys=weight_keys, refused=REFUSED, implemented=IMPLEMENTED,
    presets=PRESETS, samplers=SAMPLERS, tensor_parallel=True, warmup_cases=WARMUP_CASES,
    published_call="llada.generate")
