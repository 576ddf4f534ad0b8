"""SDAR (JetAstra/SDAR: SDAR-1.7B/4B/8B-Chat, SDARForCausalLM; "Synergy of Diffusion and
AutoRegression"): a dense Qwen3 network trained for block diffusion, served by its
generate.py, JetEngine, LMDeploy and SGLang. Qwen3's geometry and checkpoint layout (grouped-
query attention, per-head q/k RMSNorm before RoPE, head_dim independent of the width, RoPE
tables cast to the model dtype, SwiGLU), attention causal across blocks and bidirectional inside
one. Sampling: block_diffusion_generate (generate.py) is the block-diffusion sampler with SDAR's
knobs below. Sources (JetAstra/SDAR at c2041a8: generate.py, training/model/SDAR-{4B,8B}-Chat/
config.json, generation_config.json, modeling_sdar.py) and deviations: docs/MODELS.md."""

from __future__ import annotations

from ...checkpoint_fields import COMMON, OFF, is_, special_ids
from ...config import ModelConfig
from ...config.hf_read import checked, get, need, theta
from .base import Family, Samplers
from .dream import common_hf
from .keys import attention_keys, layered, mlp_keys, qk_norm_keys

# config.json's ids (mask_token_id 151669: <MASK> in added_tokens.json, SGLang's SDAR mask id)
DEFAULT_IDS = {"mask_token_id": 151669, "eos_token_id": 151643, "bos_token_id": 151643, "eot_token_id": None,
               "pad_token_id": None}
REFUSED = {
    "hidden_act": (is_(None, "silu"), "'silu'", "only the SwiGLU (silu) feed-forward is implemented"),
    "use_sliding_window": (OFF, "false", "sliding-window attention is not implemented"),
    **COMMON,
}
IMPLEMENTED = frozenset({
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "rope_theta", "rope_parameters", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "block_size",
    # training switches of modeling_sdar.py that never touch inference
    "attn_implementation", "debug", "ep_size", "fuse_cross_entropy", "micro_forward", "skip_checkpoint",
    "use_deepep"})
# block_diffusion_generate(): confidence_threshold 0.85, block_length 4 (generate.py's command line;
# the default remasking_strategy low_confidence_dynamic = the threshold rule); steps not capped by
# gen_length; probabilities in the logits' dtype; topk(confidence, k) not clamped to the masked
# count; stops at every id of generation_config.json's eos_token_id; no token editing
SAMPLER_PARAMS = {"block_length": 4, "threshold": 0.85, "cap_steps": False, "logits_fp32": False,
                  "clamp_fill": False, "every_eos": True, "editing": False}


def parse(raw: dict) -> ModelConfig:
    d, heads = need(raw, "hidden_size"), need(raw, "num_attention_heads")
    vocab, bias = need(raw, "vocab_size"), bool(raw.get("attention_bias", False))
    return checked(ModelConfig(
        family="sdar", hidden=d, num_layers=need(raw, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=get(raw, "num_key_value_heads", heads), head_dim=get(raw, "head_dim", d // heads),
        ffn=need(raw, "intermediate_size"), vocab=vocab, rope_theta=theta(raw, 10000.0),
        rms_eps=get(raw, "rms_norm_eps", 1e-6), **special_ids(raw, DEFAULT_IDS, vocab), rope_fp32=False,
        qkv_bias=bias, o_bias=bias, qk_norm=True, tied=bool(raw.get("tie_word_embeddings", False)),
        max_seq_len=get(raw, "max_position_embeddings", 32768), block_causal=True))


def checkpoint_defaults(raw: dict, folder) -> dict:
    """The trained block length (config.json's block_size: 4, 8, ... 64 across the releases)."""
    size = raw.get("block_size")
    return {"block_length": size} if isinstance(size, int) and not isinstance(size, bool) and size > 0 else {}


def to_hf(cfg: ModelConfig) -> dict:
    return {**common_hf(cfg), "model_type": "sdar", "architectures": ["SDARForCausalLM"],
            "intermediate_size": cfg.ffn, "attention_bias": cfg.qkv_bias, "tie_word_embeddings": cfg.tied,
            "hidden_act": "silu", "use_sliding_window": False}


def layer_keys(cfg: ModelConfig, p: str) -> dict:
    keys = attention_keys(cfg, p, cfg.qkv_bias) | qk_norm_keys(cfg, p)
    if cfg.o_bias:   # attention_bias: q, k, v and o all carry one
        keys["o_bias"] = (p + "self_attn.o_proj.bias", (cfg.hidden,))
    return keys | mlp_keys(cfg, p)


def weight_keys(cfg: ModelConfig, tied: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    return layered(cfg, tied, lambda i, p: layer_keys(cfg, p))


def _preset(hidden: int, ffn: int) -> ModelConfig:
    """training/model/SDAR-{4B,8B}-Chat/config.json (36 layers, 32 q / 8 K/V heads of 128, untied
    head, rope_theta 1e6) with generation_config.json's end-of-text ids."""
    return ModelConfig(family="sdar", hidden=hidden, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                       ffn=ffn, vocab=151936, rope_theta=1e6, rms_eps=1e-6, mask_id=151669, eos_id=151643,
                       bos_id=151643, extra_eos_ids=(151645,), rope_fp32=False, qk_norm=True,
                       max_seq_len=32768, block_causal=True)


PRESETS = {"sdar-4b": _preset(2560, 9728), "sdar-8b": _preset(4096, 12288)}

FAMILY = Family(
    name="sdar", display="SDAR", model_types=("sdar",), parse=parse, to_hf=to_hf, weight_keys=weight_keys,
    refused=REFUSED, implemented=IMPLEMENTED, presets=PRESETS, samplers=Samplers("block_diffusion"),
    sampler_params=SAMPLER_PARAMS, checkpoint_defaults=checkpoint_defaults, reads_generation_config=False)
