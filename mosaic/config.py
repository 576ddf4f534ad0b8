"""Frozen configs: the model (parsed from config.json), the engine, and one generation request."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

from .checkpoint_fields import check_fields, special_ids
from .errors import CheckpointError, InputError

FAMILIES = ("llada", "dream", "llada_moe")


@dataclass(frozen=True)
class ModelConfig:
    family: str                # llada | dream | llada_moe
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
        """config.json in the family's published field names (inverse of from_hf)."""
        eos = [self.eos_id, *self.extra_eos_ids] if self.extra_eos_ids else self.eos_id
        ids = {"mask_token_id": self.mask_id, "eos_token_id": eos,
               "bos_token_id": self.bos_id, "pad_token_id": self.pad_id}
        if self.family == "llada":
            return {"model_type": "llada", "d_model": self.hidden, "n_layers": self.num_layers,
                    "n_heads": self.num_heads, "n_kv_heads": self.num_kv_heads,
                    "mlp_hidden_size": self.ffn, "vocab_size": self.vocab,
                    "embedding_size": self.vocab, "rope_theta": self.rope_theta,
                    "rms_norm_eps": self.rms_eps, "rope_full_precision": self.rope_fp32,
                    "include_qkv_bias": self.qkv_bias, "weight_tying": False,
                    "max_sequence_length": self.max_seq_len, "eot_token_id": self.eot_id, **ids}
        common = {"hidden_size": self.hidden, "num_hidden_layers": self.num_layers,
                  "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                  "head_dim": self.head_dim, "vocab_size": self.vocab, "rope_theta": self.rope_theta,
                  "rms_norm_eps": self.rms_eps, "max_position_embeddings": self.max_seq_len,
                  "tie_word_embeddings": False, **ids}
        if self.family == "dream":
            return {"model_type": "Dream", "intermediate_size": self.ffn, **common}
        return {"model_type": "llada", "num_experts": self.num_experts,
                "num_experts_per_tok": self.top_k, "expert_intermediate_size": self.ffn,
                "partial_rotary_factor": self.rot_dim / self.head_dim, "qk_layernorm": self.qk_norm,
                "qkv_bias": self.qkv_bias, "norm_topk_prob": False,
                "moe_layer_freq": [1] * self.num_layers, **common}

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
        raise CheckpointError(
            f"unknown model_type {raw.get('model_type')!r} in config.json; supported: 'llada' "
            "(dense LLaDA, or LLaDA-MoE when num_experts is present; also 'lladamoe') and 'Dream'")


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
        max_seq_len=_get(raw, "max_sequence_length", 4096)))


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
        max_seq_len=_get(raw, "max_position_embeddings", 32768)))


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
        max_seq_len=_get(raw, "max_position_embeddings", 4096)))


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
    if bad:
        raise CheckpointError(f"config.json describes a model that cannot run: {'; '.join(bad)}")
    return cfg


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_bytes(value: str | int | float | None, total: int | None = None) -> int | None:
    """'40GiB', '40GB', '512MB', '123B', an int (bytes) or a fraction 0 < f <= 1 of `total` (the
    card; '0.5' as a string too). A string number > 1 without a unit is refused (InputError)."""
    if value is None:
        return None
    if isinstance(value, float) and 0 < value <= 1:
        if total is None:
            raise InputError(f"memory budget {value} is a fraction of the card, but there is no card")
        return int(value * total)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = _SIZE.match(value) if isinstance(value, str) else None
    if not m:
        raise InputError(f"cannot read memory size {value!r}; write e.g. '40GiB', '24GB' or 0.5")
    num, unit = float(m.group(1)), (m.group(2) or "").lower()
    if unit == "" and 0 < num <= 1:
        return parse_bytes(num, total)
    if unit == "" and num == 0:
        return 0
    if unit == "":  # '2' is far more likely a forgotten 'GiB' than two bytes
        raise InputError(f"memory size {value!r} has no unit; write e.g. '{value.strip()}GiB', "
                         f"'{value.strip()}GB', '{value.strip()}B' (bytes) or a fraction 0 < f <= 1 of the card")
    unit = unit if unit in _UNITS else unit + "b"
    return int(num * _UNITS[unit])


SPARSE_PATTERNS = ("dense", "window", "topk", "global_local")
SPARSE_ESTIMATES = ("minmax", "rows", "mean")


@dataclass(frozen=True)
class SparseRange:
    """The attention pattern of a range of layers (block-sparse attention, opt-in and lossy).

    layers: (first, last), inclusive, 0-based; pattern: dense | window (each query block reads
    the `window` key blocks on each side of its own) | topk (the key blocks of highest pooled
    q·k score, `keep` of them as a fraction of all key blocks, always with the local window and
    the first `global_blocks`) | global_local (the first `global_blocks` plus the window)."""
    layers: tuple[int, int]
    pattern: str = "topk"
    keep: float = 0.2
    window: int = 1
    global_blocks: int = 1

    def __post_init__(self):
        lay = tuple(self.layers) if isinstance(self.layers, (list, tuple)) else ()
        if len(lay) != 2 or not all(isinstance(i, int) and i >= 0 for i in lay) or lay[0] > lay[1]:
            raise InputError(f"sparse layers={self.layers!r}: give [first, last] layer indices, first <= last")
        object.__setattr__(self, "layers", lay)
        if self.pattern not in SPARSE_PATTERNS:
            raise InputError(f"sparse pattern={self.pattern!r} is not one of {SPARSE_PATTERNS}")
        if not 0 < self.keep <= 1:
            raise InputError(f"sparse keep={self.keep!r} must be in (0, 1] (a fraction of key blocks)")
        for name in ("window", "global_blocks"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise InputError(f"sparse {name}={v!r} must be an integer >= 0")


@dataclass(frozen=True)
class SparseConfig:
    """Block-sparse attention per layer range. block: rows (and keys) per block, a power of two
    >= 16; dense_steps: the first denoising steps of a request stay dense (SparseD: early steps
    decide the answer's layout); layers without a range stay dense. estimate: the topk block
    score's key side (kernels/sparse_select.py): minmax (channel-wise key bounds per block, an
    upper bound of the block's largest q·k, after Quest), rows (the same bounds against every
    query row instead of the pooled query: the few answer rows of a block keep their far blocks;
    1/block of the attention's FLOPs) or mean (the mean key of each block, which dilutes a single
    matching key: lossier on retrieval and copying)."""
    ranges: tuple[SparseRange, ...] = ()
    block: int = 128
    dense_steps: int = 1
    estimate: str = "minmax"

    def __post_init__(self):
        rs = tuple(r if isinstance(r, SparseRange) else _coerce(SparseRange, r) for r in self.ranges)
        object.__setattr__(self, "ranges", rs)
        if not isinstance(self.block, int) or self.block < 16 or self.block & (self.block - 1):
            raise InputError(f"sparse block={self.block!r} must be a power of two >= 16")
        if not isinstance(self.dense_steps, int) or self.dense_steps < 0:
            raise InputError(f"sparse dense_steps={self.dense_steps!r} must be an integer >= 0")
        if self.estimate not in SPARSE_ESTIMATES:
            raise InputError(f"sparse estimate={self.estimate!r} is not one of {SPARSE_ESTIMATES}")
        seen: dict[int, int] = {}
        for i, r in enumerate(rs):
            for layer in range(r.layers[0], r.layers[1] + 1):
                if layer in seen:
                    raise InputError(f"sparse ranges {seen[layer]} and {i} both cover layer {layer}")
                seen[layer] = i

    def for_layer(self, layer: int) -> SparseRange | None:
        for r in self.ranges:
            if r.layers[0] <= layer <= r.layers[1]:
                return None if r.pattern == "dense" else r
        return None

    def max_keep(self, num_k_blocks: int) -> int:
        """The most key blocks any range keeps per query block (buffer sizes)."""
        return max((min(num_k_blocks, keep_count(r, num_k_blocks)) for r in self.ranges
                    if r.pattern != "dense"), default=1)

    @classmethod
    def coerce(cls, value) -> SparseConfig | None:
        return None if value is None else _coerce(cls, value)


def keep_count(r: SparseRange, num_k_blocks: int) -> int:
    """Key blocks a query block reads under range r: the forced window and global blocks plus,
    for topk, enough top-scored blocks to reach keep * num_k_blocks."""
    forced = r.global_blocks + 2 * r.window + 1
    if r.pattern == "topk":
        return max(forced, math.ceil(r.keep * num_k_blocks - 1e-9))
    return forced


OFFLOAD_CHOICES = ("off", "auto", "weights", "weights+kv")
PRECISION_DTYPES = ("model", "bf16", "fp8")


@dataclass(frozen=True)
class PrecisionRange:
    """The weight precision of a range of layers. layers: (first, last), inclusive, 0-based;
    dtype: model (the model dtype) | bf16 (the same on a bf16 model) | fp8 (e4m3 weights with a
    scale per output channel, activations quantized per token at run time: opt-in, lossy)."""
    layers: tuple[int, int]
    dtype: str = "fp8"

    def __post_init__(self):
        lay = tuple(self.layers) if isinstance(self.layers, (list, tuple)) else ()
        if len(lay) != 2 or not all(isinstance(i, int) and i >= 0 for i in lay) or lay[0] > lay[1]:
            raise InputError(f"precision layers={self.layers!r}: give [first, last] layer indices, first <= last")
        object.__setattr__(self, "layers", lay)
        if self.dtype not in PRECISION_DTYPES:
            raise InputError(f"precision dtype={self.dtype!r} is not one of {PRECISION_DTYPES}")


@dataclass(frozen=True)
class PrecisionConfig:
    """Weight precision per layer (FP8 is opt-in and lossy; docs/FP8.md).

    ranges: explicit dtypes by layer range (layers without a range keep the model dtype);
    auto: choose the FP8 layers by sensitivity (policy/precision.py) so that the weights fit
    target_weight_bytes ('8GiB', bytes, or a fraction 0 < f <= 1 of the 16-bit weights) with the
    least total sensitivity; method: kl (each layer quantized alone, KL of the masked logits on
    calibration canvases) | local (each layer's own output error, one forward pass);
    calibration: canvases used; embed: model | fp8 (the embedding table, per-row scales)."""
    ranges: tuple[PrecisionRange, ...] = ()
    auto: bool = False
    target_weight_bytes: str | int | float | None = None
    method: str = "kl"
    calibration: int = 16
    embed: str = "model"

    def __post_init__(self):
        rs = tuple(r if isinstance(r, PrecisionRange) else _coerce(PrecisionRange, r) for r in self.ranges)
        object.__setattr__(self, "ranges", rs)
        seen: dict[int, int] = {}
        for i, r in enumerate(rs):
            for layer in range(r.layers[0], r.layers[1] + 1):
                if layer in seen:
                    raise InputError(f"precision ranges {seen[layer]} and {i} both cover layer {layer}")
                seen[layer] = i
        if self.auto and rs:
            raise InputError("precision: give either ranges or auto: true (with target_weight_bytes), not both")
        if self.auto and self.target_weight_bytes is None:
            raise InputError("precision auto: true needs target_weight_bytes ('8GiB', bytes, or a fraction "
                             "0 < f <= 1 of the 16-bit weights)")
        if self.target_weight_bytes is not None:
            t = self.target_weight_bytes
            if isinstance(t, bool) or not (isinstance(t, float) and 0 < t <= 1) and \
                    parse_bytes(t if not isinstance(t, float) else int(t)) <= 0:
                raise InputError(f"precision target_weight_bytes={t!r}: bytes ('8GiB') or a fraction 0 < f <= 1")
        if self.method not in ("kl", "local"):
            raise InputError(f"precision method={self.method!r} is not one of ('kl', 'local')")
        if not isinstance(self.calibration, int) or isinstance(self.calibration, bool) or self.calibration < 1:
            raise InputError(f"precision calibration={self.calibration!r} must be a positive integer")
        if self.embed not in ("model", "fp8"):
            raise InputError(f"precision embed={self.embed!r} is not one of ('model', 'fp8')")

    def for_layer(self, layer: int) -> str:
        """'fp8' or 'model' for one layer under the explicit ranges (auto: decided elsewhere)."""
        for r in self.ranges:
            if r.layers[0] <= layer <= r.layers[1]:
                return "fp8" if r.dtype == "fp8" else "model"
        return "model"

    @classmethod
    def coerce(cls, value) -> PrecisionConfig | None:
        """None, a PrecisionConfig, a mapping of its fields, or a list of ranges (YAML's
        `precision: [{layers: [0, 3], dtype: bf16}, ...]`)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, (list, tuple)):
            return cls(ranges=tuple(value))
        return _coerce(cls, value)


PLANNER_CHOICES = ("first-fit", "greedy-size", "best", "ilp")   # brute force: tests only (<= 8 buffers)
LOGITS_KERNEL_CHOICES = ("auto", "triton", "torch")
# the paper's API words (Mosaic, ICML 2026): logits_kernel 'mask_only' = this engine's masked-row
# logits ('auto'), 'full' = full [N, V] logits, i.e. the native forward; chunking_strategy 'lazy'
# (the search), 'none' (one chunk per phase) or fixed counts; max_seq_len = max_length
LOGITS_WORDS = {"mask_only": "auto", "full": "auto"}
CHUNKING_WORDS = ("lazy", "none")
ENGINE_ALIASES = {"max_seq_len": "max_length"}
ATTENTION_CHOICES = ("sdpa", "cudnn", "triton")
ARENA_CHOICES = ("auto", "host", "vmm")
KV_TIER_CHOICES = ("auto", "device", "host")   # where a block cache's K/V live (policy/kv_tier.py)
CACHE_CHOICES = ("none", "prefix", "dual")     # Fast-dLLM block caches
DTYPE_CHOICES = ("auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32")
_DEVICE = re.compile(r"^(auto|cpu|meta|cuda(:\d+)?)$")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model. Every field is checked at construction (InputError).

    device: auto | cpu | cuda | cuda:N; dtype: auto (bf16 on a GPU, fp32 on a CPU) or a name;
    native: the published forward + sampler (the baseline and oracle); planner: how buffers are
    placed in the workspace; memory_budget: '40GiB', bytes, or a fraction 0 < f <= 1 of the card;
    chunks: fixed (attention, ffn, logits) chunk counts instead of the lazy search; max_chunks:
    the most chunks the search may use per phase; max_length: refuse longer requests (tokens);
    logits_kernel / attention / arena: kernel and workspace choices; peer_rows: the most rows per
    piece of a peer's K/V under sequence parallelism; peer_overlap: the next piece travels while
    the current one is attended (two receive slots; same arithmetic either way); sanitize: poison
    dead buffers and check reads; kv_tier: where a Fast-dLLM block cache's K/V live (auto |
    device | host, policy/kv_tier.py); offload: layer weights (and K/V) in host memory, streamed
    in (off | auto | weights | weights+kv, docs/OFFLOAD.md), prefetch_layers layers ahead,
    kv_block_rows key rows per streamed block; precision: per-layer FP8 weights (docs/FP8.md).

    The paper's words are accepted too: logits_kernel='mask_only' (= 'auto') or 'full' (full
    logits: the native forward, native=True); chunking_strategy='lazy' (default: the search),
    'none' (chunks (1, 1, 1)) or three counts (= chunks); max_seq_len (a dict key of coerce(),
    = max_length; the engine checks it against the budget at construction)."""
    device: str = "auto"
    dtype: str = "auto"
    native: bool = False
    planner: str = "greedy-size"
    memory_budget: str | int | float | None = None
    chunks: tuple[int, int, int] | None = None
    max_chunks: int = 4096
    min_attention_rows: int = 0      # speed floor: query rows per attention chunk (costs some L_max)
    max_length: int | None = None
    logits_kernel: str = "auto"
    elementwise_kernel: str = "auto"   # fused RMSNorm / RoPE / SwiGLU (same bits as the op chains)
    attention: str = "sdpa"          # sdpa (PyTorch's order, as the reference) | cudnn | triton (Mosaic's)
    arena: str = "auto"
    peer_rows: int = 16384
    sparse: SparseConfig | None = None   # block-sparse attention (opt-in, lossy)
    peer_overlap: bool = True
    offload: str = "off"             # off | auto | weights | weights+kv (docs/OFFLOAD.md)
    prefetch_layers: int = 1         # offload: layers copied ahead of the one computing
    kv_block_rows: int = 32768       # weights+kv: key rows per block streamed from host memory
    precision: PrecisionConfig | tuple[PrecisionRange, ...] | None = None   # per-layer FP8 (lossy)
    sanitize: bool = False
    progress: bool = True
    kv_tier: str = "auto"            # block caches: auto | device | host (docs/FAST_DECODING.md)
    chunking_strategy: str | tuple[int, int, int] | None = None

    def __post_init__(self):
        if isinstance(self.logits_kernel, str) and self.logits_kernel in LOGITS_WORDS:
            if self.logits_kernel == "full":
                object.__setattr__(self, "native", True)
            object.__setattr__(self, "logits_kernel", LOGITS_WORDS[self.logits_kernel])
        if self.chunking_strategy is not None:
            fixed = _chunking(self.chunking_strategy)
            if self.chunks is not None and fixed != tuple(self.chunks):
                raise InputError(f"chunking_strategy={self.chunking_strategy!r} contradicts chunks={self.chunks!r}; "
                                 "give one of them")
            object.__setattr__(self, "chunks", fixed)
        object.__setattr__(self, "sparse", SparseConfig.coerce(self.sparse))
        if self.kv_tier not in KV_TIER_CHOICES:
            raise InputError(f"kv_tier={self.kv_tier!r} is not one of {KV_TIER_CHOICES}")
        object.__setattr__(self, "precision", PrecisionConfig.coerce(self.precision))
        if self.offload not in OFFLOAD_CHOICES:
            raise InputError(f"offload={self.offload!r} is not one of {OFFLOAD_CHOICES}")
        for name, allowed in (("planner", PLANNER_CHOICES), ("logits_kernel", LOGITS_KERNEL_CHOICES),
                              ("elementwise_kernel", LOGITS_KERNEL_CHOICES),
                              ("attention", ATTENTION_CHOICES), ("arena", ARENA_CHOICES),
                              ("dtype", DTYPE_CHOICES)):
            if getattr(self, name) not in allowed:
                words = (*allowed, *LOGITS_WORDS) if name == "logits_kernel" else allowed
                raise InputError(f"{name}={getattr(self, name)!r} is not one of {words}")
        if not isinstance(self.device, str) or not _DEVICE.match(self.device):
            raise InputError(f"device={self.device!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.memory_budget is not None:
            if isinstance(self.memory_budget, bool):
                raise InputError(f"memory_budget={self.memory_budget!r}: write e.g. '40GiB', bytes, or 0.5")
            nbytes = parse_bytes(self.memory_budget, total=2**60)   # a fraction is checked against a card later
            if nbytes <= 0:
                raise InputError(f"memory_budget={self.memory_budget!r} must be positive")
        if self.chunks is not None:
            c = tuple(self.chunks)
            if len(c) != 3 or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in c):
                raise InputError(f"chunks={self.chunks!r}: three positive counts (attention, ffn, logits)")
            object.__setattr__(self, "chunks", c)
        if not isinstance(self.min_attention_rows, int) or self.min_attention_rows < 0:
            raise InputError(f"min_attention_rows={self.min_attention_rows!r} must be an integer >= 0")
        for name in ("max_chunks", "peer_rows", "prefetch_layers", "kv_block_rows"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(f"{name}={v!r} must be a positive integer")
        if self.max_length is not None and (not isinstance(self.max_length, int) or isinstance(self.max_length, bool)
                                            or self.max_length < 1):
            raise InputError(f"max_length={self.max_length!r} must be a positive integer or None")
        for name in ("native", "sanitize", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name}={getattr(self, name)!r} must be True or False")

    @property
    def max_seq_len(self) -> int | None:
        """The paper's name for max_length (tokens)."""
        return self.max_length

    @classmethod
    def coerce(cls, value: EngineConfig | dict | None) -> EngineConfig:
        if isinstance(value, dict):
            both = [k for k in ENGINE_ALIASES if k in value and ENGINE_ALIASES[k] in value]
            if both:
                raise InputError(f"give {both[0]} or {ENGINE_ALIASES[both[0]]}, not both")
            value = {ENGINE_ALIASES.get(k, k): v for k, v in value.items()}
        return _coerce(cls, value)


def _chunking(value) -> tuple[int, int, int] | None:
    """chunking_strategy -> fixed chunk counts (None: the lazy search)."""
    if value == "lazy":
        return None
    if value == "none":
        return (1, 1, 1)
    if isinstance(value, str) and value.count(",") == 2:
        try:
            value = tuple(int(p) for p in value.split(","))
        except ValueError:
            pass
    if (isinstance(value, (tuple, list)) and len(value) == 3
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in value)):
        return tuple(value)
    raise InputError(f"chunking_strategy={value!r}: use 'lazy' (search the smallest chunking that fits), "
                     "'none' (no chunking) or three positive counts (attention, ffn, logits)")


_LLADA = {"sampler": "LLaDA"}
_DREAM = {"sampler": "Dream"}
_FAST = {"sampler": "Fast-dLLM"}


@dataclass(frozen=True)
class GenerationConfig:
    """One request's sampling options (HF convention: explicit > generation_config.json > these).

    Shared: max_new_tokens (LLaDA's gen_length), steps (default max_new_tokens), temperature,
    seed. The other fields belong to one family's sampler (their metadata says which); a sampler
    refuses another family's options set away from their defaults. cache / threshold / factor
    select Fast-dLLM's accelerated sampler of the family (opt-in, lossy; docs/FAST_DECODING.md):
    Raises InputError for a value outside its range or threshold and factor together."""
    max_new_tokens: int = 128
    steps: int | None = None
    block_length: int | None = field(default=None, metadata=_LLADA)  # default: one block
    temperature: float = 0.0
    cfg_scale: float = field(default=0.0, metadata=_LLADA)
    remasking: str = field(default="low_confidence", metadata=_LLADA)     # low_confidence | random
    confidence_dtype: str = field(default="model", metadata=_LLADA)       # model (bf16) | float64 (older)
    logits_eos_inf: bool = field(default=False, metadata=_LLADA)
    confidence_eos_eot_inf: bool = field(default=False, metadata=_LLADA)
    alg: str = field(default="maskgit_plus", metadata=_DREAM)  # origin | maskgit_plus | topk_margin | entropy
    alg_temp: float | None = field(default=None, metadata=_DREAM)
    top_p: float | None = field(default=None, metadata=_DREAM)
    top_k: int | None = field(default=None, metadata=_DREAM)
    eps: float = field(default=1e-3, metadata=_DREAM)
    seed: int | None = None
    extra: dict = field(default_factory=dict, compare=False)
    # Fast-dLLM (opt-in, lossy; docs/FAST_DECODING.md): block K/V cache and parallel commits
    cache: str = field(default="none", metadata=_FAST)            # none | prefix | dual
    threshold: float | None = field(default=None, metadata=_FAST)  # commit every position >= this
    factor: float | None = field(default=None, metadata=_FAST)     # rank n commits if conf >= 1 - f/(n+1)

    def __post_init__(self):
        if self.cache not in CACHE_CHOICES:
            raise InputError(f"cache={self.cache!r} is not one of {CACHE_CHOICES}")
        for name in ("threshold", "factor"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise InputError(f"{name}={v!r} must be a number or None")
        if self.threshold is not None and not 0 < self.threshold <= 1:
            raise InputError(f"threshold={self.threshold} must be in (0, 1] (a probability; "
                             "Fast-dLLM's evaluations use 0.9)")
        if self.factor is not None and not self.factor > 0:
            raise InputError(f"factor={self.factor} must be positive (Fast-dLLM's factor rule commits the "
                             "n-th most confident position when its confidence is >= 1 - factor / (n + 1))")
        if self.threshold is not None and self.factor is not None:
            raise InputError("threshold and factor are two alternative commit rules; set one of them")

    @property
    def accelerated(self) -> bool:
        """Whether this request asks for a Fast-dLLM sampler (a cache or a parallel commit rule)."""
        return self.cache != "none" or self.threshold is not None or self.factor is not None

    @classmethod
    def coerce(cls, value: GenerationConfig | dict | None) -> GenerationConfig:
        return _coerce(cls, value)


def _coerce(cls, value):
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        known = {f.name for f in fields(cls)}
        bad = sorted(set(value) - known)
        if bad:
            raise InputError(f"unknown {cls.__name__} fields {bad}; known: {sorted(known)}")
        return cls(**value)
    raise InputError(f"expected a {cls.__name__} or a dict, got {type(value).__name__}")
