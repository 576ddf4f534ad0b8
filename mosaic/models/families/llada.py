"""LLaDA (dense; GSAI-ML/LLaDA-8B, OLMo-derived configuration_llada.py / modeling_llada.py):
plain multi-head attention, no biases (include_qkv_bias optional), RoPE applied in fp32, a
separate LM head; checkpoint keys under model.transformer., the block's down projection and the
LM head sharing the leaf name ff_out. Sampling: LLaDA's generate.py (runtime/samplers/llada.py).
Source: docs/MODELS.md."""

from __future__ import annotations

from ...checkpoint_fields import COMMON, NONE, OFF, is_, special_ids
from ...config import ModelConfig
from ...config.hf_read import checked, get, need, theta, trained_length
from .base import Family, Samplers

# the published generate.py's defaults and LLaDA-8B's config
DEFAULT_IDS = {"mask_token_id": 126336, "eos_token_id": 126081, "bos_token_id": 126080,
               "eot_token_id": 126348, "pad_token_id": 126081}
REFUSED = {
    "activation_type": (is_(None, "silu"), "'silu'", "only the SwiGLU (silu) feed-forward is implemented"),
    "block_type": (is_(None, "llama"), "'llama'", "only LLaDA's llama block is implemented"),
    "layer_norm_type": (is_(None, "rms"), "'rms'", "only RMSNorm is implemented"),
    "layer_norm_with_affine": (is_(None, True), "true", "norms without weights are not implemented"),
    "bias_for_layer_norm": (OFF, "false", "norm biases are not implemented"),
    "include_bias": (OFF, "false", "biases on every linear layer are not implemented (include_qkv_bias is)"),
    "attention_layer_norm": (OFF, "false", "q/k layer norms are not implemented for dense LLaDA"),
    "alibi": (OFF, "false", "ALiBi is not implemented (RoPE is)"),
    "rope": (is_(None, True), "true", "models without RoPE are not implemented"),
    "clip_qkv": (NONE, "null", "q/k/v clipping is not implemented"),
    "input_emb_norm": (OFF, "false", "embedding normalisation is not implemented"),
    "scale_logits": (OFF, "false", "logit scaling is not implemented"),
    **COMMON,
}
IMPLEMENTED = frozenset({
    "d_model", "hidden_size", "n_layers", "num_hidden_layers", "n_heads", "num_attention_heads", "n_kv_heads",
    "effective_n_kv_heads", "multi_query_attention", "mlp_hidden_size", "intermediate_size", "mlp_ratio",
    "embedding_size", "vocab_size", "rope_theta", "rope_parameters", "rms_norm_eps", "rope_full_precision",
    "include_qkv_bias", "weight_tying", "tie_word_embeddings", "max_sequence_length", "max_position_embeddings"})
# options that reach a different kernel or allocation pattern (engine/warmup.py); iLLaDA and
# LLaDA-MoE sample with the same sampler
WARMUP_CASES = ({"temperature": 0.5}, {"cfg_scale": 1.0}, {"remasking": "random"},
                {"confidence_dtype": "float64"}, {"logits_eos_inf": True, "temperature": 0.5})
SAMPLERS = Samplers("llada", fast="fast_llada", speculative="speculative_llada")
IS_MOE = ("num_experts", "moe_num_experts", "n_routed_experts")


def parse(raw: dict) -> ModelConfig:
    d = need(raw, "d_model", "hidden_size")
    heads = need(raw, "n_heads", "num_attention_heads")
    kv = 1 if raw.get("multi_query_attention") else \
        get(raw, "effective_n_kv_heads", 0) or get(raw, "n_kv_heads", 0) or heads
    ffn = raw.get("mlp_hidden_size") or raw.get("intermediate_size")
    if ffn is None:
        ffn = int(get(raw, "mlp_ratio", 0.0) * d) if "mlp_ratio" in raw else need(raw, "mlp_hidden_size")
    vocab = need(raw, "embedding_size", "vocab_size")
    return checked(ModelConfig(
        family="llada", hidden=d, num_layers=need(raw, "n_layers", "num_hidden_layers"),
        num_heads=heads, num_kv_heads=int(kv), head_dim=d // heads, ffn=int(ffn), vocab=vocab,
        rope_theta=theta(raw, 10000.0), rms_eps=get(raw, "rms_norm_eps", 1e-5),
        **special_ids(raw, DEFAULT_IDS, vocab), rope_fp32=bool(raw.get("rope_full_precision", True)),
        qkv_bias=bool(raw.get("include_qkv_bias", False)), max_seq_len=trained_length(raw, 4096)))


def hf_ids(cfg: ModelConfig) -> dict:
    """The special ids in config.json's names (an end-of-text list when there are several)."""
    eos = [cfg.eos_id, *cfg.extra_eos_ids] if cfg.extra_eos_ids else cfg.eos_id
    return {"mask_token_id": cfg.mask_id, "eos_token_id": eos, "bos_token_id": cfg.bos_id, "pad_token_id": cfg.pad_id}


def to_hf(cfg: ModelConfig) -> dict:
    return {"model_type": "llada", "d_model": cfg.hidden, "n_layers": cfg.num_layers, "n_heads": cfg.num_heads,
            "n_kv_heads": cfg.num_kv_heads, "mlp_hidden_size": cfg.ffn, "vocab_size": cfg.vocab,
            "embedding_size": cfg.vocab, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_eps,
            "rope_full_precision": cfg.rope_fp32, "include_qkv_bias": cfg.qkv_bias, "weight_tying": False,
            "max_sequence_length": cfg.max_seq_len, "eot_token_id": cfg.eot_id, **hf_ids(cfg)}


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


PRESETS = {
    "llada-8b": ModelConfig(
        family="llada", hidden=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
        ffn=12288, vocab=126464, rope_theta=500000.0, rms_eps=1e-5, mask_id=126336,
        eos_id=126081, bos_id=126080, eot_id=126348, pad_id=126081),
}

FAMILY = Family(
    name="llada", display="LLaDA", model_types=("llada",), claims=lambda raw: not any(k in raw for k in IS_MOE),
    parse=parse, to_hf=to_hf, weight_keys=weight_keys, refused=REFUSED, implemented=IMPLEMENTED,
    presets=PRESETS, samplers=SAMPLERS, tensor_parallel=True, warmup_cases=WARMUP_CASES,
    published_call="llada.generate")
