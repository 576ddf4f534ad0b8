"""Dream (Dream-org/Dream-v0-Instruct-7B, Qwen2-derived configuration_dream.py): grouped-query
attention with q/k/v biases, RoPE tables in the model dtype, and the logit shift: masked
position j is predicted from hidden state j-1 (position 0 from itself). A left-padded batch masks
pad rows and columns and numbers positions from the first real token. Sampling: Dream's
diffusion_generate (runtime/samplers/dream.py). Source: docs/MODELS.md."""

from __future__ import annotations

from ...checkpoint_fields import COMMON, OFF, is_, special_ids
from ...config import ModelConfig
from ...config.hf_read import checked, get, need, theta, trained_length
from .base import Family, Samplers
from .keys import attention_keys, layered, mlp_keys
from .llada import hf_ids

DEFAULT_IDS = {"mask_token_id": 151666, "eos_token_id": 151643, "bos_token_id": None,
               "eot_token_id": None, "pad_token_id": 151643}
REFUSED = {
    "hidden_act": (is_(None, "silu"), "'silu'", "only the SwiGLU (silu) feed-forward is implemented"),
    "use_sliding_window": (OFF, "false", "sliding-window attention is not implemented"),
    "use_mrope": (OFF, "false", "multimodal RoPE is not implemented"),
    "layer_types": (lambda v: v is None or all(t == "full_attention" for t in v), "full_attention only",
                    "sliding-window layers are not implemented"),
    **COMMON,
}
IMPLEMENTED = frozenset({
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "rope_theta", "rope_parameters", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings"})
WARMUP_CASES = ({"alg": "origin", "temperature": 0.5}, {"alg": "maskgit_plus"}, {"alg": "topk_margin"},
                {"alg": "entropy"}, {"temperature": 0.5, "top_p": 0.9}, {"temperature": 0.5, "top_k": 20})


def parse(raw: dict) -> ModelConfig:
    d = need(raw, "hidden_size")
    heads = need(raw, "num_attention_heads")
    vocab = need(raw, "vocab_size")
    return checked(ModelConfig(
        family="dream", hidden=d, num_layers=need(raw, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=get(raw, "num_key_value_heads", heads), head_dim=get(raw, "head_dim", d // heads),
        ffn=need(raw, "intermediate_size"), vocab=vocab, rope_theta=theta(raw, 10000.0),
        rms_eps=get(raw, "rms_norm_eps", 1e-6), **special_ids(raw, DEFAULT_IDS, vocab), rope_fp32=False,
        qkv_bias=True, logit_shift=True, max_seq_len=trained_length(raw, 32768)))


def common_hf(cfg: ModelConfig) -> dict:
    """The Qwen / Llama-style geometry fields several families write."""
    return {"hidden_size": cfg.hidden, "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab,
            "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_eps, "max_position_embeddings": cfg.max_seq_len,
            "tie_word_embeddings": False, **hf_ids(cfg)}


def to_hf(cfg: ModelConfig) -> dict:
    return {"model_type": "Dream", "intermediate_size": cfg.ffn, **common_hf(cfg)}


def weight_keys(cfg: ModelConfig, tied: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    return layered(cfg, tied, lambda i, p: attention_keys(cfg, p, cfg.qkv_bias) | mlp_keys(cfg, p))


PRESETS = {
    "dream-7b": ModelConfig(
        family="dream", hidden=3584, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
        ffn=18944, vocab=152064, rope_theta=1e6, rms_eps=1e-6, mask_id=151666, eos_id=151643,
        pad_id=151643, rope_fp32=False, qkv_bias=True, logit_shift=True, max_seq_len=32768),
}

FAMILY = Family(
    name="dream", display="Dream", model_types=("dream",), parse=parse, to_hf=to_hf, weight_keys=weight_keys,
    refused=REFUSED, implemented=IMPLEMENTED, presets=PRESETS,
    samplers=Samplers("dream", fast="fast_dream", speculative="speculative_dream"), padding="rows",
    tensor_parallel=True, warmup_cases=WARMUP_CASES, published_call="dream.diffusion_generate")
