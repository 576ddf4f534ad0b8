"""LLaDA2.x (inclusionAI LLaDA2.0 / 2.1, LLaDA2MoeModelLM; BailingMoeV2-derived): a block
diffusion MoE. Fused q/k/v projection (split into q, k, v views of one tensor at load time),
per-head q/k RMSNorm, partial RoPE, the first `first_dense` layers dense FFNs, then MoE layers
with shared experts, a bias-corrected group-limited router (models/moe_grouped.py) and its
weights normalised and scaled as the config says. Keys under model.word_embeddings / model.layers
/ model.norm / lm_head. Samples with the block-diffusion sampler (runtime/samplers/
block_diffusion.py; LLaDA2.1's token editing where the request or the checkpoint asks for it).
Source: docs/MODELS.md."""

from __future__ import annotations

from ...checkpoint_fields import COMMON, OFF, is_, special_ids
from ...config import ModelConfig
from ...config.hf_read import as_kind, checked, get, need, theta
from ...errors import CheckpointError
from .base import Family, Samplers
from .dream import common_hf
from .keys import expert_keys, mlp_keys
from .published_code import generate_defaults

ROUTE_SCORES = ("softmax", "sigmoid")
# generate(): mask_id=156895, eos_id=156892 (the config's pad_token_id too)
DEFAULT_IDS = {"mask_token_id": 156895, "eos_token_id": 156892, "bos_token_id": None, "eot_token_id": None,
               "pad_token_id": 156892}
REFUSED = {
    "hidden_act": (is_(None, "silu"), "'silu'", "only the SwiGLU (silu) experts are implemented"),
    "norm_head": (OFF, "false", "a normalised LM head is not implemented"),
    "norm_softmax": (OFF, "false", "a normalised softmax is not implemented"),
    "use_sliding_window": (OFF, "false", "sliding-window attention is not implemented"),
    "use_rmsnorm": (is_(None, True), "true", "only RMSNorm is implemented"),
    "using_split_qkv_in_self_attention": (OFF, "false", "separate q/k/v projections are not "
                                                        "implemented (the fused query_key_value is)"),
    "router_dtype": (is_(None, "fp32", "float32"), "'fp32'", "the published router runs in float32"),
    "num_experts": (lambda v: isinstance(v, int) and v > 0, "a positive count",
                    "dense LLaDA2 models (no experts) are not implemented"),
    **COMMON,
}
IMPLEMENTED = frozenset({
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "rope_theta", "rope_parameters", "rms_norm_eps", "max_position_embeddings", "partial_rotary_factor",
    "rotary_dim", "num_experts", "num_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
    "intermediate_size", "first_k_dense_replace", "n_group", "topk_group", "score_function", "norm_topk_prob",
    "routed_scaling_factor", "moe_router_enable_expert_bias", "use_qk_norm", "use_qkv_bias", "use_bias",
    "tie_word_embeddings"})
FUSED = {"qkv": ("q", "k", "v"), "qkv_bias": ("q_bias", "k_bias", "v_bias")}   # split into views
# the published generate()'s defaults (dFactory 49c315c, the hub's LLaDA2.0 / 2.1 copies): the
# block-diffusion sampler's knobs (runtime/samplers/block_diffusion.py)
SAMPLER_PARAMS = {"block_length": 32, "threshold": 0.95, "cap_steps": True, "logits_fp32": True, "clamp_fill": True,
                  "every_eos": False, "editing": True}
# the arguments of the checkpoint's own generate() that choose and tune LLaDA2.1's token editing
# (a LLaDA2.0 generate() has none of them: its checkpoints keep LLaDA2.0's sampler)
EDITING_ARGS = ("editing_threshold", "max_post_steps", "num_to_transfer")
# sampling reaches the filtered softmax and the step's noise (engine/warmup.py)
WARMUP_CASES = ({"temperature": 0.5, "top_p": 0.9},)


def checkpoint_defaults(raw: dict, folder) -> dict:
    """LLaDA2.1's editing defaults when the checkpoint's generate() has them (published_code.py)."""
    found = generate_defaults(raw, folder, EDITING_ARGS)
    return found if isinstance(found.get("editing_threshold"), (int, float)) else {}


def routing_problems(cfg: ModelConfig) -> list[str]:
    """What the published group-limited router cannot run (models/moe_grouped.py)."""
    bad, groups, keep = [], cfg.num_groups, cfg.topk_groups
    if groups < 1 or cfg.num_experts % groups or not 0 < keep <= groups:
        bad.append(f"{cfg.num_experts} experts in {groups} groups keeping {keep} (n_group must divide "
                   "num_experts, 1 <= topk_group <= n_group)")
    elif groups > 1 and (cfg.num_experts // groups < 2 or keep * cfg.num_experts // groups < cfg.top_k):
        bad.append(f"{cfg.top_k} experts per token from {keep} groups of {cfg.num_experts // groups} (the "
                   "published router needs 2 experts per group and enough experts in the kept groups)")
    if cfg.route_score not in ROUTE_SCORES:
        bad.append(f"score_function {cfg.route_score!r} (supported: {', '.join(ROUTE_SCORES)})")
    if not 0 <= cfg.first_dense <= cfg.num_layers or (cfg.first_dense and cfg.dense_ffn <= 0):
        bad.append(f"first_k_dense_replace {cfg.first_dense} with intermediate_size {cfg.dense_ffn}")
    return bad


def parse(raw: dict) -> ModelConfig:
    """Fused q/k/v, per-head q/k RMSNorm, partial RoPE, the first first_k_dense_replace layers
    dense, then MoE with shared experts and group-limited routing."""
    d, heads = need(raw, "hidden_size"), need(raw, "num_attention_heads")
    hd = get(raw, "head_dim", d // heads)
    vocab = need(raw, "vocab_size")
    rot = int(hd * get(raw, "partial_rotary_factor", 1.0))
    if raw.get("rotary_dim") is not None and as_kind(raw, "rotary_dim", int) != rot:
        raise CheckpointError(f"config.json: rotary_dim={raw['rotary_dim']} but head_dim * partial_rotary_factor = "
                              f"{rot}; the published code rotates the latter")
    moe_f = need(raw, "moe_intermediate_size")
    # the published attention always normalises q and k (dFactory); the hub's remote code asks
    # use_qk_norm, whose published configs set it
    cfg = ModelConfig(
        family="llada2", hidden=d, num_layers=need(raw, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=get(raw, "num_key_value_heads", heads), head_dim=hd, ffn=moe_f, vocab=vocab,
        rope_theta=theta(raw, 10000.0), rms_eps=get(raw, "rms_norm_eps", 1e-5),
        **special_ids(raw, DEFAULT_IDS, vocab), rotary_dim=rot, rope_fp32=False,
        qkv_bias=bool(raw.get("use_qkv_bias", False)), o_bias=bool(raw.get("use_bias", False)),
        qk_norm=bool(raw.get("use_qk_norm", True)), num_experts=need(raw, "num_experts"),
        top_k=need(raw, "num_experts_per_tok"), tied=bool(raw.get("tie_word_embeddings", False)),
        first_dense=get(raw, "first_k_dense_replace", 0), dense_ffn=get(raw, "intermediate_size", 0) or 0,
        shared_ffn=moe_f * get(raw, "num_shared_experts", 0), num_groups=get(raw, "n_group", 1) or 1,
        topk_groups=get(raw, "topk_group", 1) or 1, route_score=str(raw.get("score_function") or "sigmoid"),
        route_norm=bool(raw.get("norm_topk_prob", True)), route_scale=get(raw, "routed_scaling_factor", 1.0),
        route_bias=True, max_seq_len=get(raw, "max_position_embeddings", 16384), block_causal=True)
    return checked(cfg, routing_problems(cfg))


def to_hf(cfg: ModelConfig) -> dict:
    return {**common_hf(cfg), "model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"],
            "tie_word_embeddings": cfg.tied, "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
            "moe_intermediate_size": cfg.ffn, "num_shared_experts": cfg.shared_ffn // cfg.ffn,
            "intermediate_size": cfg.dense_ffn, "first_k_dense_replace": cfg.first_dense, "n_group": cfg.num_groups,
            "topk_group": cfg.topk_groups, "score_function": cfg.route_score, "norm_topk_prob": cfg.route_norm,
            "routed_scaling_factor": cfg.route_scale, "moe_router_enable_expert_bias": cfg.route_bias,
            "use_qk_norm": cfg.qk_norm, "use_qkv_bias": cfg.qkv_bias, "use_bias": cfg.o_bias,
            "partial_rotary_factor": cfg.rot_dim / cfg.head_dim, "hidden_act": "silu"}


def layer_keys(cfg: ModelConfig, i: int, p: str) -> dict:
    d, a, m = cfg.hidden, p + "attention.", p + "mlp."
    qkv = cfg.q_dim + 2 * cfg.kv_dim
    keys = {"attn_norm": (p + "input_layernorm.weight", (d,)),
            "ffn_norm": (p + "post_attention_layernorm.weight", (d,)),
            "qkv": (a + "query_key_value.weight", (qkv, d)), "o": (a + "dense.weight", (d, cfg.q_dim))}
    if cfg.qkv_bias:
        keys["qkv_bias"] = (a + "query_key_value.bias", (qkv,))
    if cfg.o_bias:
        keys["o_bias"] = (a + "dense.bias", (d,))
    if cfg.qk_norm:
        keys["q_norm"] = (a + "query_layernorm.weight", (cfg.head_dim,))
        keys["k_norm"] = (a + "key_layernorm.weight", (cfg.head_dim,))
    if i < cfg.first_dense:
        return keys | mlp_keys(cfg, p, cfg.dense_ffn)
    keys["router"] = (m + "gate.weight", (cfg.num_experts, d))
    keys["router_bias"] = (m + "gate.expert_bias", (cfg.num_experts,))   # a buffer the class always has
    if cfg.shared_ffn:
        keys |= {"shared_" + k: (hf.replace("mlp.", "mlp.shared_experts."), shape)
                 for k, (hf, shape) in mlp_keys(cfg, p, cfg.shared_ffn).items()}
    return keys | expert_keys(cfg, m)


def weight_keys(cfg: ModelConfig, tied: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Canonical key -> (checkpoint key, shape)."""
    keys = {"embed": ("model.word_embeddings.weight", (cfg.vocab, cfg.hidden)),
            "final_norm": ("model.norm.weight", (cfg.hidden,))}
    if not tied:
        keys["lm_head"] = ("lm_head.weight", (cfg.vocab, cfg.hidden))
    for i in range(cfg.num_layers):
        keys |= {f"layers.{i}.{k}": v for k, v in layer_keys(cfg, i, f"model.layers.{i}.").items()}
    return keys


PRESETS = {
    # inclusionAI/dFactory configs/model_configs/llada2_mini/config.json (commit 49c315c)
    "llada2-mini": ModelConfig(
        family="llada2", hidden=2048, num_layers=20, num_heads=16, num_kv_heads=4, head_dim=128,
        ffn=512, vocab=157184, rope_theta=600000.0, rms_eps=1e-6, mask_id=156895, eos_id=156892,
        pad_id=156892, rotary_dim=64, rope_fp32=False, qk_norm=True, num_experts=256, top_k=8,
        first_dense=1, dense_ffn=5120, shared_ffn=512, num_groups=8, topk_groups=4,
        route_score="sigmoid", route_norm=True, route_scale=2.5, route_bias=True, max_seq_len=16384,
        block_causal=True),
}

FAMILY = Family(
    name="llada2", display="LLaDA2", model_types=("llada2_moe", "llada2_moe_veomni", "bailing_moe_v2"),
    parse=parse, to_hf=to_hf, weight_keys=weight_keys, refused=REFUSED, implemented=IMPLEMENTED, presets=PRESETS,
    samplers=Samplers("block_diffusion", fast="block_diffusion"), fused=FUSED, moe_block="grouped",
    sampler_params=SAMPLER_PARAMS, checkpoint_defaults=checkpoint_defaults, warmup_cases=WARMUP_CASES)
