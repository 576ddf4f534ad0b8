"""How the engine runs a model (EngineConfig): device, dtype, kernels, workspace, budget,
chunking, offload, block-sparse attention and per-layer precision."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InputError
from .precision import PrecisionConfig, PrecisionRange
from .sparse import SparseConfig
from .values import check_choice, check_int, coerce, is_int, parse_bytes

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
OFFLOAD_CHOICES = ("off", "auto", "weights", "weights+kv")
PARALLEL_CHOICES = ("sequence", "tensor")   # what several processes split (docs/PARALLEL.md)
MOE_KERNEL_CHOICES = ("auto", "loop", "grouped", "triton")   # routed experts (kernels.moe_kernel)
DTYPE_CHOICES = ("auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32")
FUSED_CHOICES = ("auto", "all", "off")   # fused projections in block steps (models/fusion.py)
# a batched block step's attention over every sequence (kernels.varlen_kernel; paged is no kernel)
VARLEN_KERNEL_CHOICES = ("auto", "loop", "flash", "efficient", "gather", "triton")
TRANSIENT_POOL_CHOICES = ("auto", "mempool", "shared")   # where a step's transients live (memory/transient.py)
_DEVICE = re.compile(r"^(auto|cpu|meta|cuda(:\d+)?)$")
# name -> allowed values, checked alike
_CHOICES = {"planner": PLANNER_CHOICES, "logits_kernel": LOGITS_KERNEL_CHOICES,
            "elementwise_kernel": LOGITS_KERNEL_CHOICES, "attention": ATTENTION_CHOICES,
            "arena": ARENA_CHOICES, "dtype": DTYPE_CHOICES, "kv_tier": KV_TIER_CHOICES,
            "offload": OFFLOAD_CHOICES, "cuda_graphs": ("auto", "off"), "parallel": PARALLEL_CHOICES,
            "moe_kernel": MOE_KERNEL_CHOICES, "fused_projections": FUSED_CHOICES,
            "varlen_kernel": VARLEN_KERNEL_CHOICES, "transient_pool": TRANSIENT_POOL_CHOICES}


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
    kv_block_rows key rows per streamed block; precision: per-layer FP8 weights (docs/FP8.md);
    batch_invariant: each sequence's values (and so its tokens) do not depend on what it is
    batched with: fixed-tile matrix products without split-K, fixed split counts in the logits
    and attention kernels (docs/MODELS.md); parallel: what several processes (--gpus K, torchrun)
    split: 'sequence' (default: each rank holds a slice of every sequence's positions) or 'tensor'
    (each rank holds a share of every layer's heads and FFN columns and loads only those weights;
    docs/PARALLEL.md). One process ignores it. fused_projections: 'auto' (default) runs each
    layer's gate and up projections in a block cache's block steps as one GEMM over one fused
    [2F, d] matrix that replaces the two (same bytes: models/fusion.py; the same bits as two
    GEMMs, checked on the GPU by tests/gpu/test_fused_gpu.py); 'all' also runs q, k and v as one
    GEMM there (opt-in and labelled: cuBLAS may round a 32-row [3d, d] product differently from
    three [d, d] ones: bench/results/gpu/session7/design_probe_29bb6f0.json); 'off' keeps them apart.
    round_tokens: the tokens one round of the Scheduler puts through the model before a Fast-dLLM
    block cache's fill is run in slices of its layers that ride along with the other requests'
    steps (chunked joining; the same tokens; None: fills run whole; `mosaic serve` sets 2048
    unless given). varlen_kernel: a batched block step's attention over every sequence
    (kernels.varlen_kernel): 'auto' (the per-sequence loop on a CPU; flash, else efficient, else
    the loop on CUDA; in batch-invariant mode Mosaic's Triton varlen kernel, else the loop) or one
    of loop | flash | efficient | gather | triton (a named kernel that cannot run on this device,
    dtype and heads, or is not batch-invariant in that mode, is an InputError at construction).
    transient_pool: where a budgeted GPU step's out-of-plan transients live (memory/transient.py):
    'auto' (a private torch.cuda.MemPool where torch has one, else 'shared'), 'mempool' or
    'shared' (a segment reserved in the default pool; for measurement or a torch MemPool bug).

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
    moe_kernel: str = "auto"         # routed experts: auto | loop | grouped (same bits) | triton (lossy)
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
    cuda_graphs: str = "auto"        # auto (CUDA; budgeted: where graphs fit) | off: captured steps (runtime/graphs.py)
    threads: int | None = None       # CPU: torch's intra-op threads (None: 1 for a small model, see engine.py)
    # every row's values independent of its batch-mates and of the batch size (fixed-tile GEMMs,
    # fixed split counts, fixed-order combines): docs/MODELS.md "Batch-invariant mode"
    batch_invariant: bool = False
    parallel: str = "sequence"       # several processes: sequence | tensor (docs/PARALLEL.md)
    fused_projections: str = "auto"  # block steps: auto (gate|up fused: same bits) | all (+ q|k|v, labelled) | off
    # tokens a Scheduler round puts through the model before block-cache fills run in slices of
    # layers (chunked joining, engine/scheduler.py; the same tokens). None: fills run whole
    round_tokens: int | None = None
    varlen_kernel: str = "auto"      # batched block steps' attention: auto | loop | flash | efficient | gather | triton
    transient_pool: str = "auto"     # budgeted GPU steps' transients: auto | mempool | shared (memory/transient.py)

    def __post_init__(self):
        self._paper_words()
        object.__setattr__(self, "sparse", SparseConfig.coerce(self.sparse))
        object.__setattr__(self, "precision", PrecisionConfig.coerce(self.precision))
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                words = (*allowed, *LOGITS_WORDS) if name == "logits_kernel" else allowed
                check_choice("", name, getattr(self, name), words)
        if not isinstance(self.device, str) or not _DEVICE.match(self.device):
            raise InputError(f"device={self.device!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
        _check_budget(self.memory_budget)
        if self.chunks is not None:
            object.__setattr__(self, "chunks", _chunk_counts(self.chunks, "chunks"))
        check_int("", "min_attention_rows", self.min_attention_rows, 0)
        for name in ("max_chunks", "peer_rows", "prefetch_layers", "kv_block_rows"):
            check_int("", name, getattr(self, name), 1)
        check_int("", "max_length", self.max_length, 1, optional=True)
        check_int("", "threads", self.threads, 1, optional=True)
        check_int("", "round_tokens", self.round_tokens, 1, optional=True)
        for name in ("native", "sanitize", "progress", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name}={getattr(self, name)!r} must be True or False")

    def _paper_words(self) -> None:
        """logits_kernel 'mask_only' / 'full' and chunking_strategy, the paper's API words."""
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
        return coerce(cls, value)


def _check_budget(budget) -> None:
    if budget is None:
        return
    if isinstance(budget, bool):
        raise InputError(f"memory_budget={budget!r}: write e.g. '40GiB', bytes, or 0.5")
    if parse_bytes(budget, total=2**60) <= 0:   # a fraction is checked against a card later
        raise InputError(f"memory_budget={budget!r} must be positive: a size ('40GiB', '512MiB', bytes) or a "
                         f"fraction 0 < f <= 1 of the GPU")


def _chunk_counts(value, name: str) -> tuple[int, int, int]:
    c = tuple(value) if isinstance(value, (tuple, list)) else ()
    if len(c) != 3 or not all(is_int(i) and i >= 1 for i in c):
        raise InputError(f"{name}={value!r}: three positive counts (attention, ffn, logits)")
    return c


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
    try:
        return _chunk_counts(value, "chunking_strategy")
    except InputError:
        raise InputError(f"chunking_strategy={value!r}: use 'lazy' (search the smallest chunking that fits), "
                         "'none' (no chunking) or three positive counts (attention, ffn, logits)") from None
