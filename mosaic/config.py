"""Frozen configs: the model (parsed from config.json), the engine, and one generation request."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field, fields
from typing import Any

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
    eos_id: int
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
    max_seq_len: int = 4096    # trained length; longer is allowed

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
        ids = {"mask_token_id": self.mask_id, "eos_token_id": self.eos_id,
               "bos_token_id": self.bos_id, "pad_token_id": self.pad_id}
        if self.family == "llada":
            return {"model_type": "llada", "d_model": self.hidden, "n_layers": self.num_layers,
                    "n_heads": self.num_heads, "n_kv_heads": self.num_kv_heads,
                    "mlp_hidden_size": self.ffn, "vocab_size": self.vocab,
                    "embedding_size": self.vocab, "rope_theta": self.rope_theta,
                    "rms_norm_eps": self.rms_eps, "rope_full_precision": self.rope_fp32,
                    "include_bias": self.qkv_bias, "weight_tying": False,
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
        mtype = str(raw.get("model_type", "")).lower()
        is_moe = any(k in raw for k in ("num_experts", "moe_num_experts", "n_routed_experts"))
        if mtype == "llada" and is_moe:
            return _parse_moe(raw)
        if mtype == "llada":
            return _parse_llada(raw)
        if mtype == "dream":
            return _parse_dream(raw)
        raise CheckpointError(
            f"unknown model_type {raw.get('model_type')!r} in config.json; supported: 'llada' "
            "(dense LLaDA, or LLaDA-MoE when num_experts is present) and 'Dream'")


def _need(raw: dict, *names: str, kind=int):
    for n in names:
        if raw.get(n) is not None:
            return kind(raw[n])
    raise CheckpointError(f"config.json lacks {' / '.join(names)}")


def _get(raw: dict, name: str, default):
    v = raw.get(name)
    return default if v is None else type(default)(v) if default is not None else v


def _parse_llada(raw: dict) -> ModelConfig:
    d = _need(raw, "d_model", "hidden_size")
    heads = _need(raw, "n_heads", "num_attention_heads")
    kv = raw.get("effective_n_kv_heads") or raw.get("n_kv_heads") or heads
    ffn = raw.get("mlp_hidden_size") or raw.get("intermediate_size")
    if ffn is None:
        ffn = int(raw["mlp_ratio"] * d) if "mlp_ratio" in raw else _need(raw, "mlp_hidden_size")
    return ModelConfig(
        family="llada", hidden=d, num_layers=_need(raw, "n_layers", "num_hidden_layers"),
        num_heads=heads, num_kv_heads=int(kv), head_dim=d // heads, ffn=int(ffn),
        vocab=_need(raw, "embedding_size", "vocab_size"),
        rope_theta=_get(raw, "rope_theta", 10000.0), rms_eps=_get(raw, "rms_norm_eps", 1e-5),
        mask_id=_get(raw, "mask_token_id", 126336), eos_id=_get(raw, "eos_token_id", 126081),
        bos_id=_get(raw, "bos_token_id", 126080), eot_id=_get(raw, "eot_token_id", 126348),
        pad_id=_get(raw, "pad_token_id", 126081), rope_fp32=bool(raw.get("rope_full_precision", True)),
        qkv_bias=bool(raw.get("include_bias", False) or raw.get("include_qkv_bias", False)),
        max_seq_len=_get(raw, "max_sequence_length", 4096))


def _parse_dream(raw: dict) -> ModelConfig:
    d = _need(raw, "hidden_size")
    heads = _need(raw, "num_attention_heads")
    return ModelConfig(
        family="dream", hidden=d, num_layers=_need(raw, "num_hidden_layers"), num_heads=heads,
        num_kv_heads=_get(raw, "num_key_value_heads", heads), head_dim=_get(raw, "head_dim", d // heads),
        ffn=_need(raw, "intermediate_size"), vocab=_need(raw, "vocab_size"),
        rope_theta=_get(raw, "rope_theta", 10000.0), rms_eps=_get(raw, "rms_norm_eps", 1e-6),
        mask_id=_get(raw, "mask_token_id", 151666), eos_id=_get(raw, "eos_token_id", 151643),
        bos_id=raw.get("bos_token_id"), pad_id=_get(raw, "pad_token_id", 151643),
        rope_fp32=False, qkv_bias=True, logit_shift=True,
        max_seq_len=_get(raw, "max_position_embeddings", 32768))


def _parse_moe(raw: dict) -> ModelConfig:
    d = _need(raw, "hidden_size", "d_model")
    heads = _need(raw, "num_attention_heads", "n_heads")
    hd = _get(raw, "head_dim", d // heads)
    shared = raw.get("shared_expert_intermediate_size")
    if shared:
        raise CheckpointError(f"LLaDA-MoE with a shared expert ({shared}) is not supported")
    freq = raw.get("moe_layer_freq")
    if isinstance(freq, list) and not all(int(f) == 1 for f in freq):
        raise CheckpointError("LLaDA-MoE with dense layers (moe_layer_freq has zeros) is not supported")
    return ModelConfig(
        family="llada_moe", hidden=d, num_layers=_need(raw, "num_hidden_layers", "n_layers"),
        num_heads=heads, num_kv_heads=_get(raw, "num_key_value_heads", heads), head_dim=hd,
        ffn=_need(raw, "expert_intermediate_size", "moe_intermediate_size", "intermediate_size"),
        vocab=_need(raw, "vocab_size", "embedding_size"),
        rope_theta=_get(raw, "rope_theta", 50000.0), rms_eps=_get(raw, "rms_norm_eps", 1e-5),
        mask_id=_get(raw, "mask_token_id", 156895), eos_id=_get(raw, "eos_token_id", 156892),
        bos_id=raw.get("bos_token_id"), pad_id=raw.get("pad_token_id"),
        rotary_dim=int(hd * float(raw.get("partial_rotary_factor", 1.0))), rope_fp32=False,
        qkv_bias=bool(raw.get("qkv_bias", False)), qk_norm=bool(raw.get("qk_layernorm", True)),
        num_experts=_need(raw, "num_experts", "moe_num_experts", "n_routed_experts"),
        top_k=_need(raw, "num_experts_per_tok", "moe_top_k", "top_k"),
        max_seq_len=_get(raw, "max_position_embeddings", 4096))


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_bytes(value: str | int | float | None, total: int | None = None) -> int | None:
    """'40GiB', '40GB', 12345 (bytes) or a fraction 0 < f <= 1 of `total` (the card)."""
    if value is None:
        return None
    if isinstance(value, float) and 0 < value <= 1:
        if total is None:
            raise InputError(f"memory budget {value} is a fraction of the card, but there is no card")
        return int(value * total)
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE.match(value)
    if not m:
        raise InputError(f"cannot read memory size {value!r}; write e.g. '40GiB', '24GB' or 0.5")
    num, unit = float(m.group(1)), (m.group(2) or "").lower()
    if unit == "" and num <= 1 and "." in m.group(1):
        return parse_bytes(num, total)
    unit = unit if unit in _UNITS else unit + "b"
    return int(num * _UNITS[unit])


PLANNER_CHOICES = ("first-fit", "greedy-size", "best", "ilp")   # brute force: tests only (<= 8 buffers)
LOGITS_KERNEL_CHOICES = ("auto", "triton", "torch")
# the paper's API words (Mosaic, ICML 2026): logits_kernel 'mask_only' = this engine's masked-row
# logits ('auto'), 'full' = full [N, V] logits, i.e. the native forward; chunking_strategy 'lazy'
# (the search), 'none' (one chunk per phase) or fixed counts; max_seq_len = max_length
LOGITS_WORDS = {"mask_only": "auto", "full": "auto"}
CHUNKING_WORDS = ("lazy", "none")
ENGINE_ALIASES = {"max_seq_len": "max_length"}
ATTENTION_CHOICES = ("sdpa", "cudnn")
ARENA_CHOICES = ("auto", "host", "vmm")
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
    logits_kernel / attention / arena: kernel and workspace choices; peer_rows: rows per piece of
    a peer's K/V under sequence parallelism; sanitize: poison dead buffers and check reads.

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
    max_length: int | None = None
    logits_kernel: str = "auto"
    attention: str = "sdpa"          # sdpa (PyTorch's order, as the reference) | cudnn (cuDNN first on Hopper)
    arena: str = "auto"
    peer_rows: int = 16384
    sanitize: bool = False
    progress: bool = True
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
        for name, allowed in (("planner", PLANNER_CHOICES), ("logits_kernel", LOGITS_KERNEL_CHOICES),
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
        for name in ("max_chunks", "peer_rows"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(f"{name}={v!r} must be a positive integer")
        if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 1):
            raise InputError(f"max_length={self.max_length!r} must be a positive integer or None")

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


@dataclass(frozen=True)
class GenerationConfig:
    """One request's sampling options (HF convention: explicit > generation_config.json > these).

    Shared: max_new_tokens (LLaDA's gen_length), steps (default max_new_tokens), temperature,
    seed. The other fields belong to one family's sampler (their metadata says which); a sampler
    refuses another family's options set away from their defaults."""
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
