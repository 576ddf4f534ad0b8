"""config.json written back in a family's published field names (ModelConfig.to_hf): the
inverse of the parsers in model.py, used to save checkpoints and by the compat layer."""

from __future__ import annotations

from typing import Any


def hf_fields(cfg) -> dict[str, Any]:
    """config.json in the family's published field names (inverse of from_hf)."""
    eos = [cfg.eos_id, *cfg.extra_eos_ids] if cfg.extra_eos_ids else cfg.eos_id
    ids = {"mask_token_id": cfg.mask_id, "eos_token_id": eos,
           "bos_token_id": cfg.bos_id, "pad_token_id": cfg.pad_id}
    if cfg.family == "llada":
        return {"model_type": "llada", "d_model": cfg.hidden, "n_layers": cfg.num_layers,
                "n_heads": cfg.num_heads, "n_kv_heads": cfg.num_kv_heads,
                "mlp_hidden_size": cfg.ffn, "vocab_size": cfg.vocab,
                "embedding_size": cfg.vocab, "rope_theta": cfg.rope_theta,
                "rms_norm_eps": cfg.rms_eps, "rope_full_precision": cfg.rope_fp32,
                "include_qkv_bias": cfg.qkv_bias, "weight_tying": False,
                "max_sequence_length": cfg.max_seq_len, "eot_token_id": cfg.eot_id, **ids}
    common = {"hidden_size": cfg.hidden, "num_hidden_layers": cfg.num_layers,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
              "head_dim": cfg.head_dim, "vocab_size": cfg.vocab, "rope_theta": cfg.rope_theta,
              "rms_norm_eps": cfg.rms_eps, "max_position_embeddings": cfg.max_seq_len,
              "tie_word_embeddings": False, **ids}
    if cfg.family == "dream":
        return {"model_type": "Dream", "intermediate_size": cfg.ffn, **common}
    if cfg.family == "illada":
        return {**common, "model_type": "illada", "architectures": ["ILLaDAForCausalLM"],
                "intermediate_size": cfg.ffn, "tie_word_embeddings": cfg.tied,
                "attention_bias": cfg.qkv_bias, "mlp_bias": False, "hidden_act": "silu",
                "layer_norm_eps": None}
    if cfg.family == "llada2":
        return {**common, "model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"],
                "tie_word_embeddings": cfg.tied, "num_experts": cfg.num_experts,
                "num_experts_per_tok": cfg.top_k, "moe_intermediate_size": cfg.ffn,
                "num_shared_experts": cfg.shared_ffn // cfg.ffn, "intermediate_size": cfg.dense_ffn,
                "first_k_dense_replace": cfg.first_dense, "n_group": cfg.num_groups,
                "topk_group": cfg.topk_groups, "score_function": cfg.route_score,
                "norm_topk_prob": cfg.route_norm, "routed_scaling_factor": cfg.route_scale,
                "moe_router_enable_expert_bias": cfg.route_bias, "use_qk_norm": cfg.qk_norm,
                "use_qkv_bias": cfg.qkv_bias, "use_bias": cfg.o_bias,
                "partial_rotary_factor": cfg.rot_dim / cfg.head_dim, "hidden_act": "silu"}
    return {"model_type": "llada", "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.top_k, "expert_intermediate_size": cfg.ffn,
            "partial_rotary_factor": cfg.rot_dim / cfg.head_dim, "qk_layernorm": cfg.qk_norm,
            "qkv_bias": cfg.qkv_bias, "norm_topk_prob": False,
            "moe_layer_freq": [1] * cfg.num_layers, **common}
