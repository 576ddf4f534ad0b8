"""The model's geometry and special ids (ModelConfig), parsed from a checkpoint's config.json in
each family's published field names (checkpoint_fields.py judges the fields it refuses)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..checkpoint_fields import check_fields, special_ids
from ..errors import CheckpointError
from .hf_fields import hf_fields

FAMILIES = ("llada", "dream", "llada_moe", "illada", "llada2")
# families whose attention is causal across blocks and bidirectional inside one (block diffusion)
BLOCK_FAMILIES = ("llada2",)
ROUTE_SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class ModelConfig:
    family: str                # llada | dream | llada_moe | illada | llada2
    hidden: int                # d
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int                   # F (dense) or expert FFN width (MoE)
    vocab: int                 # V: width of the LM head (LLaDA: embedding_size)
    rope_theta: float
    rms_eps: float
    mask_id: int
    eos_id: int | None         # None: the checkpoint has no end-of-text token
    bos_id: int | None = None
    eot_id: int | None = None
    pad_id: int | None = None
    rotary_dim: int = 0        # 0 = head_dim; LLaDA-MoE may rotate only part of each head
    rope_fp32: bool = True     # LLaDA applies RoPE in fp32; Dream / MoE in the model dtype
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    top_k: int = 0
    logit_shift: bool = False  # Dream: masked position j reads hidden state j-1
    max_seq_len: int = 4096    # trained length; longer is allowed (with a warning)
    extra_eos_ids: tuple[int, ...] = ()  # more end-of-text ids (config.json may list several)
    tied: bool = False         # LM head = embedding (iLLaDA; a preset's byte count needs it)
    o_bias: bool = False       # a bias on the attention output projection (LLaDA2: use_bias)
    # LLaDA2 (BailingMoeV2) MoE: the first `first_dense` layers are dense FFNs of width dense_ffn;
    # the others route top_k of num_experts experts (width ffn) plus shared experts of total
    # width shared_ffn; the router scores (softmax | sigmoid) + a per-expert bias choose experts
    # within the top `topk_groups` of `num_groups` groups; route_norm renormalises the chosen
    # weights, route_scale multiplies them (models/moe_grouped.py)
    first_dense: int = 0
    dense_ffn: int = 0
    shared_ffn: int = 0
    num_groups: int = 1
    topk_groups: int = 1
    route_score: str = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0
    route_bias: bool = False

    @property
    def block_causal(self) -> bool:
        """Whether generation is block diffusion (LLaDA2): causal across blocks."""
        return self.family in BLOCK_FAMILIES

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rot_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def truncated(self, num_layers: int) -> ModelConfig:
        return dataclasses.replace(self, num_layers=num_layers)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_hf(self) -> dict[str, Any]:
        """config.json in the family's published field names (inverse of from_hf; hf_fields.py)."""
        return hf_fields(self)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a config.json dict. Raises CheckpointError naming the field for a value Mosaic
        cannot run (checkpoint_fields.py holds the table of refused fields)."""
        if not isinstance(raw, dict):
            raise CheckpointError(f"config.json holds a {type(raw).__name__}, not an object of fields")
        mtype = str(raw.get("model_type", "")).lower()
        is_moe = any(k in raw for k in ("num_experts", "moe_num_experts", "n_routed_experts"))
        if (mtype == "llada" and is_moe) or mtype in ("lladamoe", "llada_moe"):  # as some tools rename it
            return _parse_moe(raw)
        if mtype == "llada":
            return _parse_llada(raw)
        if mtype == "dream":
            return _parse_dream(raw)
        if mtype == "illada":
            return _parse_illada(raw)
        if mtype in ("llada2_moe", "llada2_moe_veomni", "bailing_moe_v2"):
            return _parse_llada2(raw)
        raise CheckpointError(
            f"unknown model_type {raw.get('model_type')!r} in config.json; supported: 'llada' "
            "(dense LLaDA, or LLaDA-MoE when num_experts is present; also 'lladamoe'), 'Dream', 'illada' "
            "(iLLaDA) and 'llada2_moe' (LLaDA2.x)")


def _need(raw: dict, *names: str, kind=int):
    for n in names:
        if raw.get(n) is not None:
            return _as(raw, n, kind)
    raise CheckpointError(f"config.json lacks {' / '.join(names)}")


def _get(raw: dict, name: str, default):
    v = raw.get(name)
    return default if v is None else _as(raw, name, type(default)) if default is not None else v


def _as(raw: dict, name: str, kind):
    v = raw[name]
    if isinstance(v, bool) and kind is not bool or isinstance(v, (list, dict, str)) and kind is not str:
        raise CheckpointError(f"config.json: {name}={v!r} is not a {kind.__name__}")
    try:
        return kind(v)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config.json: {name}={v!r} is not a {kind.__name__}") from e


def _theta(raw: dict, default: float) -> float:
    """rope_theta, or rope_parameters.rope_theta as transformers >= 5 writes it."""
    rope = raw.get("rope_parameters")
    if raw.get("rope_theta") is None and isinstance(rope, dict) and rope.get("rope_theta") is not None:
        return _as(rope, "rope_theta", float)
    return _get(raw, "rope_theta", default)


def _trained_length(raw: dict, default: int) -> int:
    """The trained length: max_sequence_length (LLaDA's name) or max_position_embeddings (HF's),
    whichever the file has (the first when both), else the family's published default."""
    for name in ("max_sequence_length", "max_position_embeddings"):
        if raw.get(name) is not None:
            return _get(raw, name, default)
    return default


def _parse_llada(raw: dict) -> ModelConfig:
    check_fields(raw, "llada")
    d = _need(raw, "d_model", "hidden_size")
    heads = _need(raw, "n_heads", "num_attention_heads")
    kv = 1 if raw.get("multi_query_attention") else \
        _get(raw, "effective_n_kv_heads", 0) or _get(raw, "n_kv_heads", 0) or heads
    ffn = raw.get("mlp_hidden_size") or raw.get("intermediate_size")
    if ffn is None:
        ffn = int(_get(raw, "mlp_ratio", 0.0) * d) if "mlp_ratio" in raw else _need(raw, "mlp_hidden_size")
    vocab = _need(raw, "embedding_size", "vocab_size")
    return _checked(ModelConfig(
        family="llada", hidden=d, num_layers=_need(raw, "n_layers", "num_hidden_layers"),
        num_heads=heads, num_kv_heads=int(kv), head_dim=d // heads, ffn=int(ffn), vocab=vocab,
        rope_theta=_theta(raw, 10000.0), rms_eps=_get(raw, "rms_norm_eps", 1e-5),
        **special_ids(raw, "llada", vocab), rope_fp32=bool(raw.get("rope_full_precision", True)),
        qkv_bias=bool(raw.get("include_qkv_bias", False)),
        max_seq_len=_trained_length(raw, 4096)))


def _parse_dream(raw: dict) -> ModelConfig:
    check_fields(raw, "dream")
    d = _need(raw, "hidden_size")
    heads = _need(raw, "num_attention_heads")
    vocab = _need(raw, "vocab_size")
    return _checked(ModelConfig(
        family="dream", hidden=d, num_layers=_need(raw, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=_get(raw, "num_key_value_heads", heads), head_dim=_get(raw, "head_dim", d // heads),
        ffn=_need(raw, "intermediate_size"), vocab=vocab,
        rope_theta=_theta(raw, 10000.0), rms_eps=_get(raw, "rms_norm_eps", 1e-6),
        **special_ids(raw, "dream", vocab), rope_fp32=False, qkv_bias=True, logit_shift=True,
        max_seq_len=_trained_length(raw, 32768)))


def _parse_moe(raw: dict) -> ModelConfig:
    check_fields(raw, "llada_moe")
    d = _need(raw, "hidden_size", "d_model")
    heads = _need(raw, "num_attention_heads", "n_heads")
    hd = _get(raw, "head_dim", d // heads)
    if hd * heads != d:  # the published attention always uses hidden_size / num_attention_heads
        raise CheckpointError(f"config.json: head_dim={hd} but hidden_size / num_attention_heads = "
                              f"{d // heads}; the published LLaDA-MoE code uses the latter")
    vocab = _need(raw, "vocab_size", "embedding_size")
    return _checked(ModelConfig(
        family="llada_moe", hidden=d, num_layers=_need(raw, "num_hidden_layers", "n_layers"),
        num_heads=heads, num_kv_heads=_get(raw, "num_key_value_heads", heads), head_dim=hd,
        ffn=_need(raw, "expert_intermediate_size", "moe_intermediate_size", "intermediate_size"),
        vocab=vocab, rope_theta=_theta(raw, 50000.0), rms_eps=_get(raw, "rms_norm_eps", 1e-5),
        **special_ids(raw, "llada_moe", vocab),
        rotary_dim=int(hd * _get(raw, "partial_rotary_factor", 1.0)), rope_fp32=False,
        qkv_bias=bool(raw.get("qkv_bias", False)), qk_norm=bool(raw.get("qk_layernorm", True)),
        num_experts=_need(raw, "num_experts", "moe_num_experts", "n_routed_experts"),
        top_k=_need(raw, "num_experts_per_tok", "moe_top_k", "top_k"),
        max_seq_len=_trained_length(raw, 4096)))


def _parse_illada(raw: dict) -> ModelConfig:
    """iLLaDA (ILLaDAForCausalLM): Llama-style names and keys, GQA, head size hidden / heads (the
    published attention ignores head_dim), RoPE tables cast to the model dtype, tied head."""
    check_fields(raw, "illada")
    d, heads = _need(raw, "hidden_size"), _need(raw, "num_attention_heads")
    if raw.get("head_dim") is not None and _as(raw, "head_dim", int) * heads != d:
        raise CheckpointError(f"config.json: head_dim={raw['head_dim']} but hidden_size / num_attention_heads = "
                              f"{d // heads}; the published iLLaDA code uses the latter")
    vocab = _need(raw, "vocab_size")
    return _checked(ModelConfig(
        family="illada", hidden=d, num_layers=_need(raw, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=_get(raw, "num_key_value_heads", heads), head_dim=d // heads,
        ffn=_need(raw, "intermediate_size"), vocab=vocab, rope_theta=_theta(raw, 10000.0),
        rms_eps=_get(raw, "rms_norm_eps", 1e-6), **special_ids(raw, "illada", vocab), rope_fp32=False,
        qkv_bias=bool(raw.get("attention_bias", False)), o_bias=bool(raw.get("attention_bias", False)),
        tied=bool(raw.get("tie_word_embeddings", True)),
        max_seq_len=_get(raw, "max_position_embeddings", 8192)))


def _parse_llada2(raw: dict) -> ModelConfig:
    """LLaDA2.x (LLaDA2MoeModelLM, BailingMoeV2-derived): fused q/k/v, per-head q/k RMSNorm,
    partial RoPE, the first first_k_dense_replace layers dense, then MoE with shared experts and
    group-limited routing."""
    check_fields(raw, "llada2")
    d, heads = _need(raw, "hidden_size"), _need(raw, "num_attention_heads")
    hd = _get(raw, "head_dim", d // heads)
    vocab = _need(raw, "vocab_size")
    rot = int(hd * _get(raw, "partial_rotary_factor", 1.0))
    if raw.get("rotary_dim") is not None and _as(raw, "rotary_dim", int) != rot:
        raise CheckpointError(f"config.json: rotary_dim={raw['rotary_dim']} but head_dim * partial_rotary_factor = "
                              f"{rot}; the published code rotates the latter")
    E = _need(raw, "num_experts")
    shared = _get(raw, "num_shared_experts", 0)
    moe_f = _need(raw, "moe_intermediate_size")
    # the published attention always normalises q and k (dFactory); the hub's remote code asks
    # use_qk_norm, whose published configs set it
    qk = bool(raw.get("use_qk_norm", True))
    score = str(raw.get("score_function") or "sigmoid")
    return _checked(ModelConfig(
        family="llada2", hidden=d, num_layers=_need(raw, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=_get(raw, "num_key_value_heads", heads), head_dim=hd, ffn=moe_f, vocab=vocab,
        rope_theta=_theta(raw, 10000.0), rms_eps=_get(raw, "rms_norm_eps", 1e-5),
        **special_ids(raw, "llada2", vocab), rotary_dim=rot, rope_fp32=False,
        qkv_bias=bool(raw.get("use_qkv_bias", False)), o_bias=bool(raw.get("use_bias", False)), qk_norm=qk,
        num_experts=E, top_k=_need(raw, "num_experts_per_tok"), tied=bool(raw.get("tie_word_embeddings", False)),
        first_dense=_get(raw, "first_k_dense_replace", 0), dense_ffn=_get(raw, "intermediate_size", 0) or 0,
        shared_ffn=moe_f * shared, num_groups=_get(raw, "n_group", 1) or 1,
        topk_groups=_get(raw, "topk_group", 1) or 1, route_score=score,
        route_norm=bool(raw.get("norm_topk_prob", True)), route_scale=_get(raw, "routed_scaling_factor", 1.0),
        route_bias=True, max_seq_len=_get(raw, "max_position_embeddings", 16384)))


def _checked(cfg: ModelConfig) -> ModelConfig:
    """Geometry a forward can run: positive sizes, heads that divide, an even rotary width."""
    sizes = {"hidden size": cfg.hidden, "layers": cfg.num_layers, "attention heads": cfg.num_heads,
             "key/value heads": cfg.num_kv_heads, "head size": cfg.head_dim, "FFN width": cfg.ffn,
             "vocabulary": cfg.vocab}
    bad = [f"{k} {v}" for k, v in sizes.items() if v <= 0]
    if cfg.num_kv_heads > 0 and cfg.num_heads % cfg.num_kv_heads:
        bad.append(f"{cfg.num_heads} attention heads are not a multiple of {cfg.num_kv_heads} key/value heads")
    if cfg.rot_dim % 2 or not 0 < cfg.rot_dim <= cfg.head_dim:
        bad.append(f"rotary width {cfg.rot_dim} (must be even and at most the head size {cfg.head_dim})")
    if cfg.num_experts and not 0 < cfg.top_k <= cfg.num_experts:
        bad.append(f"{cfg.top_k} experts per token of {cfg.num_experts}")
    if cfg.family == "llada2":
        groups, keep = cfg.num_groups, cfg.topk_groups
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
    if bad:
        raise CheckpointError(f"config.json describes a model that cannot run: {'; '.join(bad)}")
    return cfg

