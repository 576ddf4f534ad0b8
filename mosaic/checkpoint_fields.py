"""config.json fields of the three families: which Mosaic implements, which it refuses, which
do not touch inference, and the special token ids. The one place a field is judged.

Sources (field names and what the published code does with them): GSAI-ML/LLaDA-8B-Instruct
(configuration_llada.py / modeling_llada.py, OLMo-derived), Dream-org/Dream-v0-Instruct-7B
(configuration_dream.py, Qwen2-derived), inclusionAI/LLaDA-MoE-7B-A1B-Instruct
(configuration_lladamoe.py / modeling_lladamoe.py, OLMoE-derived), GSAI-ML/iLLaDA-8B-Base
(modeling_illada.py, Llama-style), inclusionAI/LLaDA2.0-mini (configuration_llada2_moe.py /
modeling_llada2_moe.py, BailingMoeV2-derived; docs/MODELS.md lists the copies read). A field that changes the
math is either read by the parser (config.py) or refused here with a CheckpointError naming it;
a field nobody knows is named in a warning, never dropped silently."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .errors import CheckpointError


class ConfigFieldWarning(UserWarning):
    """config.json has fields Mosaic does not know (they are ignored)."""


def _is(*values) -> Callable[[Any], bool]:
    return lambda v: v in values


_OFF = _is(None, False, 0)             # absent, null, false or 0
_NONE = _is(None)
_ONE = _is(None, 1, 1.0)
_ALL_MOE = lambda v: v in (None, 1) or (isinstance(v, list) and all(f == 1 for f in v))  # noqa: E731

# field -> (the values Mosaic implements, what they are, why others are refused)
Rule = tuple[Callable[[Any], bool], str, str]
_COMMON: dict[str, Rule] = {
    "quantization_config": (_NONE, "absent", "quantized weights are not supported (bf16/fp16/fp32 only)"),
    "rope_scaling": (_NONE, "null", "RoPE scaling (YaRN, linear, dynamic) is not implemented"),
}
REFUSED: dict[str, dict[str, Rule]] = {
    "llada": {
        "activation_type": (_is(None, "silu"), "'silu'", "only the SwiGLU (silu) feed-forward is implemented"),
        "block_type": (_is(None, "llama"), "'llama'", "only LLaDA's llama block is implemented"),
        "layer_norm_type": (_is(None, "rms"), "'rms'", "only RMSNorm is implemented"),
        "layer_norm_with_affine": (_is(None, True), "true", "norms without weights are not implemented"),
        "bias_for_layer_norm": (_OFF, "false", "norm biases are not implemented"),
        "include_bias": (_OFF, "false", "biases on every linear layer are not implemented "
                                        "(include_qkv_bias is)"),
        "attention_layer_norm": (_OFF, "false", "q/k layer norms are not implemented for dense LLaDA"),
        "alibi": (_OFF, "false", "ALiBi is not implemented (RoPE is)"),
        "rope": (_is(None, True), "true", "models without RoPE are not implemented"),
        "clip_qkv": (_NONE, "null", "q/k/v clipping is not implemented"),
        "input_emb_norm": (_OFF, "false", "embedding normalisation is not implemented"),
        "scale_logits": (_OFF, "false", "logit scaling is not implemented"),
        **_COMMON,
    },
    "dream": {
        "hidden_act": (_is(None, "silu"), "'silu'", "only the SwiGLU (silu) feed-forward is implemented"),
        "use_sliding_window": (_OFF, "false", "sliding-window attention is not implemented"),
        "use_mrope": (_OFF, "false", "multimodal RoPE is not implemented"),
        "layer_types": (lambda v: v is None or all(t == "full_attention" for t in v), "full_attention only",
                        "sliding-window layers are not implemented"),
        **_COMMON,
    },
    "llada_moe": {
        "hidden_act": (_is(None, "silu"), "'silu'", "only the SwiGLU (silu) experts are implemented"),
        "attention_bias": (_OFF, "false", "attention biases are not implemented for LLaDA-MoE"),
        "clip_qkv": (_NONE, "null", "q/k/v clipping is not implemented"),
        "shared_expert_intermediate_size": (_OFF, "null", "shared experts are not implemented"),
        "num_shared_experts": (_OFF, "0", "shared experts are not implemented"),
        "moe_layer_freq": (_ALL_MOE, "every layer a MoE layer (all 1)", "dense layers are not implemented"),
        "moe_router_enable_expert_bias": (_OFF, "false", "router expert biases are not implemented"),
        # the published block always applies softmax, never renormalises the top-k weights and
        # never scales them, whatever these fields say: a checkpoint that sets them asks for
        # math the reference does not run, so which one it was trained with is unknown
        "moe_router_score_function": (_is(None, "softmax"), "'softmax'",
                                      "the published LLaDA-MoE router always uses softmax"),
        "norm_topk_prob": (_OFF, "false", "the published LLaDA-MoE code never renormalises the top-k "
                                          "router weights (it ignores this field)"),
        "routed_scaling_factor": (_ONE, "1", "the published LLaDA-MoE code never scales expert outputs"),
        "router_num_group": (lambda v: v is None or v in (-2, 0, 1), "null",
                             "grouped expert routing is not implemented"),
        "router_topk_group": (lambda v: v is None or v in (-2, 0, 1), "null",
                              "grouped expert routing is not implemented"),
        **_COMMON,
    },
    "illada": {
        "hidden_act": (_is(None, "silu"), "'silu'", "only the SwiGLU (silu) feed-forward is implemented"),
        "layer_norm_eps": (_NONE, "null", "LayerNorm blocks are not implemented (RMSNorm is)"),
        "mlp_bias": (_OFF, "false", "feed-forward biases are not implemented"),
        **_COMMON,
    },
    "llada2": {
        "hidden_act": (_is(None, "silu"), "'silu'", "only the SwiGLU (silu) experts are implemented"),
        "norm_head": (_OFF, "false", "a normalised LM head is not implemented"),
        "norm_softmax": (_OFF, "false", "a normalised softmax is not implemented"),
        "use_sliding_window": (_OFF, "false", "sliding-window attention is not implemented"),
        "use_rmsnorm": (_is(None, True), "true", "only RMSNorm is implemented"),
        "using_split_qkv_in_self_attention": (_OFF, "false", "separate q/k/v projections are not "
                                                             "implemented (the fused query_key_value is)"),
        "router_dtype": (_is(None, "fp32", "float32"), "'fp32'", "the published router runs in float32"),
        "num_experts": (lambda v: isinstance(v, int) and v > 0, "a positive count",
                        "dense LLaDA2 models (no experts) are not implemented"),
        **_COMMON,
    },
}

# fields the parsers read (config.py), per family
IMPLEMENTED = {
    "llada": {"d_model", "hidden_size", "n_layers", "num_hidden_layers", "n_heads", "num_attention_heads",
              "n_kv_heads", "effective_n_kv_heads", "multi_query_attention", "mlp_hidden_size",
              "intermediate_size", "mlp_ratio", "embedding_size", "vocab_size", "rope_theta",
              "rope_parameters", "rms_norm_eps", "rope_full_precision", "include_qkv_bias",
              "weight_tying", "tie_word_embeddings", "max_sequence_length", "max_position_embeddings"},
    "dream": {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size", "rope_theta", "rope_parameters", "rms_norm_eps",
              "max_position_embeddings", "tie_word_embeddings"},
    "llada_moe": {"hidden_size", "d_model", "num_hidden_layers", "n_layers", "num_attention_heads", "n_heads",
                  "num_key_value_heads", "head_dim", "expert_intermediate_size", "moe_intermediate_size",
                  "vocab_size", "embedding_size", "rope_theta", "rope_parameters", "rms_norm_eps",
                  "max_position_embeddings", "partial_rotary_factor", "qk_layernorm", "qkv_bias", "num_experts",
                  "moe_num_experts", "n_routed_experts", "num_experts_per_tok", "moe_top_k", "top_k",
                  "tie_word_embeddings"},
    "illada": {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "vocab_size", "rope_theta", "rope_parameters", "rms_norm_eps",
               "max_position_embeddings", "tie_word_embeddings", "attention_bias"},
    "llada2": {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "vocab_size", "rope_theta", "rope_parameters", "rms_norm_eps", "max_position_embeddings",
               "partial_rotary_factor", "rotary_dim", "num_experts", "num_shared_experts", "num_experts_per_tok",
               "moe_intermediate_size", "intermediate_size", "first_k_dense_replace", "n_group", "topk_group",
               "score_function", "norm_topk_prob", "routed_scaling_factor", "moe_router_enable_expert_bias",
               "use_qk_norm", "use_qkv_bias", "use_bias", "tie_word_embeddings"},
}
SPECIAL = ("mask_token_id", "eos_token_id", "bos_token_id", "eot_token_id", "pad_token_id")
# fields that do not change inference: training, caching, dropout, bookkeeping
INERT = {
    "model_type", "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version",
    "_name_or_path", "use_cache", "initializer_range", "init_std", "init_fn", "init_device",
    "init_cutoff_factor", "precision", "attention_dropout", "residual_dropout", "embedding_dropout",
    "flash_attention", "block_group_size", "alibi_bias_max", "attention_layer_norm_with_affine",
    "output_router_logits", "router_aux_loss_coef", "dense_intermediate_size", "max_window_layers",
    "sliding_window", "output_attentions", "output_hidden_states", "return_dict", "is_encoder_decoder",
    "pretraining_tp", "rope_type", "use_qk_norm", "tokenizer_class", "pad_token", "bos_token",
    "eos_token", "mask_token", "generation_config", "id2label", "label2id", "problem_type",
    "resid_pdrop", "embd_pdrop", "output_dropout", "use_return_dict",
}


def is_dtype_name(value) -> bool:
    """A config.json dtype as transformers reads it: a torch dtype's name ("bfloat16", "float32",
    "float8_e4m3fn", ...), "auto", or null. ("float7" used to be read as nothing at all.)"""
    return value is None or value == "auto" or (isinstance(value, str) and isinstance(getattr(torch, value, None),
                                                                                      torch.dtype))


def check_fields(raw: dict, family: str) -> None:
    """Raise CheckpointError for every field whose value asks for math Mosaic does not run (all
    of them named at once); warn (ConfigFieldWarning) about fields nobody here knows."""
    bad = [f"{k}={raw[k]!r} (not a dtype; e.g. 'bfloat16', 'float16', 'float32')" for k in ("torch_dtype", "dtype")
           if k in raw and not is_dtype_name(raw[k])]
    for name, (ok, allowed, why) in REFUSED[family].items():
        if name in raw and not ok(raw[name]):
            bad.append(f"{name}={raw[name]!r} ({why}; supported: {allowed})")
    rope = raw.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
        bad.append(f"rope_parameters.rope_type={rope['rope_type']!r} (RoPE scaling is not implemented; "
                   "supported: 'default')")
    if bad:
        raise CheckpointError(f"config.json asks for what Mosaic does not implement: {'; '.join(bad)}")
    known = set(REFUSED[family]) | IMPLEMENTED[family] | set(SPECIAL) | INERT
    unknown = sorted(k for k in raw if k not in known)
    if unknown:
        warnings.warn(f"config.json fields Mosaic does not know are ignored: {unknown} (if one of them "
                      "changes the model's math, the tokens will differ from the published code's)",
                      ConfigFieldWarning, stacklevel=3)


# the published defaults of each family (None: the family has no such token)
DEFAULT_IDS = {
    "llada": {"mask_token_id": 126336, "eos_token_id": 126081, "bos_token_id": 126080,
              "eot_token_id": 126348, "pad_token_id": 126081},
    "dream": {"mask_token_id": 151666, "eos_token_id": 151643, "bos_token_id": None,
              "eot_token_id": None, "pad_token_id": 151643},
    "llada_moe": {"mask_token_id": 156895, "eos_token_id": 156892, "bos_token_id": None,
                  "eot_token_id": None, "pad_token_id": None},
    # iLLaDA's config.json names no mask id: <[MASK]> is token 5 (ML-GSAI/LLaDA README: mask_id=5), EOS 2
    "illada": {"mask_token_id": 5, "eos_token_id": 2, "bos_token_id": None, "eot_token_id": None,
               "pad_token_id": None},
    # LLaDA2.x generate(): mask_id=156895, eos_id=156892 (the config's pad_token_id too)
    "llada2": {"mask_token_id": 156895, "eos_token_id": 156892, "bos_token_id": None, "eot_token_id": None,
               "pad_token_id": 156892},
}


def special_ids(raw: dict, family: str, vocab: int) -> dict[str, Any]:
    """ModelConfig's token-id fields from config.json. Absent or null: the family's published
    default when it lies inside the vocabulary, else None (no such token). A list of end-of-text
    ids (HF allows one) gives eos_id = the first and extra_eos_ids = the rest. A value that is not
    an id inside [0, vocab) is refused naming the field. The mask token is required."""
    out: dict[str, Any] = {}
    for name in SPECIAL:
        v = raw.get(name)
        if v is None:
            d = DEFAULT_IDS[family][name]
            out[name] = d if d is not None and d < vocab else None
            if name == "mask_token_id" and out[name] is None:
                raise CheckpointError(f"config.json has no mask_token_id (the published default {d} is "
                                      f"outside this vocabulary of {vocab}); add the mask token's id")
            continue
        ids = v if isinstance(v, list) and name == "eos_token_id" else [v]
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise CheckpointError(f"config.json: {name}={v!r} is not a token id (an integer"
                                  f"{' or a list of them' if name == 'eos_token_id' else ''})")
        outside = [i for i in ids if not 0 <= i < vocab]
        if outside:
            raise CheckpointError(f"config.json: {name}={v!r} is outside the vocabulary [0, {vocab})")
        out[name] = ids[0]
        if name == "eos_token_id":
            out["extra"] = tuple(ids[1:])
    if out["mask_token_id"] == out["eos_token_id"]:
        raise CheckpointError(f"config.json: mask_token_id {out['mask_token_id']} is also eos_token_id; a "
                              "diffusion model needs a mask token of its own")
    if out["pad_token_id"] == out["mask_token_id"]:  # padding is filled with another id (engine.canvas)
        out["pad_token_id"] = None
    return {"mask_id": out["mask_token_id"], "eos_id": out["eos_token_id"], "bos_id": out["bos_token_id"],
            "eot_id": out["eot_token_id"], "pad_id": out["pad_token_id"], "extra_eos_ids": out.get("extra", ())}


# generation_config.json fields that are bookkeeping, not sampling
GENERATION_INERT = {"transformers_version", "_from_model_config", "_commit_hash"}
GENERATION_IDS = ("pad_token_id", "bos_token_id", "mask_token_id", "eot_token_id")


def generation_fields(data: dict, ids: dict[str, Any], vocab: int, sampling: set[str],
                      where: str = "generation_config.json") -> tuple[dict, dict[str, Any]]:
    """Split generation_config.json into (sampling defaults, token ids) and warn once, naming
    them, about the fields nothing reads.

    data: the file's object; ids: config.json's {"eos_id", "extra_eos_ids", "pad_id", ...} (as
    special_ids returns them); sampling: the GenerationConfig field names (and aliases) that
    become request defaults. Returns the sampling fields as given (GenerationConfig validates
    them per request) and `ids` with every end-of-text id of the file added: HF's generate stops
    at any id of `eos_token_id` (an int or a list), so a list in either file ends the text at any
    of its ids (the first of config.json stays eos_id). Other token ids that differ from
    config.json's are named in the warning (config.json's are used, as the official code uses
    the model config's). Raises CheckpointError for an end-of-text id outside [0, vocab)."""
    defaults = {k: v for k, v in data.items() if k in sampling}
    out = dict(ids)
    eos = data.get("eos_token_id")
    if eos is not None:
        listed = eos if isinstance(eos, list) else [eos]
        if not listed or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in listed):
            raise CheckpointError(f"{where}: eos_token_id={eos!r} is not a token id in [0, {vocab}) or a list of them")
        have = [i for i in [out["eos_id"], *out["extra_eos_ids"]] if i is not None]
        more = [i for i in listed if i not in have]
        if out["eos_id"] is None and more:
            out["eos_id"], more = more[0], more[1:]
        out["extra_eos_ids"] = tuple(out["extra_eos_ids"]) + tuple(dict.fromkeys(more))
    ignored = []
    for name in GENERATION_IDS:
        short = name.replace("_token_id", "_id")
        if data.get(name) is not None and data[name] != out.get(short):
            ignored.append(f"{name}={data[name]!r} (config.json's {out.get(short)!r} is used)")
    if data.get("max_length") is not None:
        ignored.append(f"max_length={data['max_length']!r} (a total-length cap of transformers' generate; "
                       "give max_new_tokens)")
    known = sampling | GENERATION_INERT | set(GENERATION_IDS) | {"eos_token_id", "max_length"}
    ignored += sorted(k for k in data if k not in known)
    if ignored:
        warnings.warn(f"{where} fields Mosaic does not read are ignored: {', '.join(ignored)}",
                      ConfigFieldWarning, stacklevel=3)
    return defaults, out
