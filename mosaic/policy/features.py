"""Which opt-in features combine, and what each says: one table, read by the engine (requests),
`mosaic plan`, the CLI and the server.

A `Setting` is what one request runs with (engine options, sampling options, path, processes);
`CONFLICTS` lists the combinations that are refused, each with its refusal text; `lossy_labels`
names every option of a setting that may change tokens relative to the reference sampler. To add
a feature: its conflicts and its label here, nowhere else."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import EngineConfig, GenerationConfig
from ..errors import InputError
from ..models.precision import FP8_NAME, ranges
from ..runtime.parallel import LOSSY as PARALLEL_LABEL
from ..runtime.parallel import TENSOR_LOSSY as TENSOR_LABEL


@dataclass(frozen=True)
class Setting:
    """What one request runs with. world: processes of sequence parallelism (1 under tensor
    parallelism); tensor: processes of tensor parallelism (1 otherwise); native: the
    published forward + sampler; draws: the sampler draws random numbers; accelerated: a
    Fast-dLLM sampler; cached: it keeps a block K/V store; device_type: 'cuda' or 'cpu'."""
    config: EngineConfig
    gen: GenerationConfig
    family: str
    native: bool = False
    world: int = 1
    draws: bool = False
    accelerated: bool = False
    cached: bool = False
    device_type: str = "cpu"
    blocks: bool = False      # a block-diffusion sampler (LLaDA2.x)
    tensor: int = 1           # tensor-parallel processes (parallel: tensor)
    coupled_draws: bool = False   # the sampler's draws read every rank's rows (Dream)
    constrained: bool = False  # an output constraint (json_schema / regex / choice: docs/STRUCTURED.md)

    @property
    def streamed_kv(self) -> bool:
        return self.config.offload in ("weights+kv", "auto")


@dataclass(frozen=True)
class Conflict:
    """A combination that is refused: when(setting) -> True means refuse with `message`."""
    name: str
    when: Callable[[Setting], bool]
    message: str


CONFLICTS = (
    Conflict("fast+native", lambda s: s.accelerated and s.native,
             "cache / threshold / factor (Fast-dLLM) run on the planned path only; drop native=True (--native)"),
    Conflict("native+processes", lambda s: s.native and s.world > 1,
             "the native path runs on one process: use the planned path (the default) under several processes, "
             "or run the native path without --gpus"),
    Conflict("draws+processes", lambda s: s.world > 1 and s.gen.seed is None and s.draws,
             "across several processes pass seed=N, so that every process draws the same random numbers (the "
             "command line always does: --seed, default 0)"),
    Conflict("cache+processes", lambda s: s.gen.cache != "none" and s.world > 1,
             "a block cache (cache 'prefix'/'dual') is not available across several processes yet; use "
             "cache='none' or one process"),
    Conflict("fast+sparse", lambda s: s.accelerated and s.config.sparse is not None,
             "block-sparse attention and the Fast-dLLM samplers cannot be combined yet"),
    Conflict("dream-sampling+processes", lambda s: s.world > 1 and s.coupled_draws and s.gen.temperature > 0,
             "Dream sampling at temperature > 0 is not available across several processes yet (its random "
             "draws depend on every rank's rows)"),
    Conflict("streamed-kv+processes", lambda s: s.streamed_kv and s.world > 1,
             "streamed K/V (offload: weights+kv or auto) is not available across several processes yet; use "
             "offload: weights"),
    Conflict("streamed-kv+sparse", lambda s: s.streamed_kv and s.config.sparse is not None,
             "block-sparse attention and streamed K/V (offload: weights+kv or auto) do not combine yet"),
    Conflict("streamed-kv+cache", lambda s: s.config.offload == "weights+kv" and s.gen.cache != "none",
             "a block cache (cache 'prefix'/'dual') keeps its K/V in its own store (kv_tier places them on the "
             "device or the host); with it use offload: weights or auto"),
    Conflict("blocks+native", lambda s: s.blocks and s.native,
             "the block-diffusion sampler runs on the planned path only (its block K/V cache is exact by "
             "construction): drop native=True (--native)"),
    Conflict("blocks+processes", lambda s: s.blocks and s.world > 1,
             "block-diffusion models run on one process (no sequence parallelism yet): drop --gpus"),
    Conflict("blocks+sparse", lambda s: s.blocks and s.config.sparse is not None,
             "block-sparse attention is not available for block-diffusion models (their attention is already "
             "block-causal over a cache)"),
    Conflict("blocks+offload", lambda s: s.blocks and s.config.offload != "off",
             "offload is not available for block-diffusion models yet; their K/V live in the block store "
             "(kv_tier: device, host or auto): use offload: off"),
    Conflict("sparse+processes", lambda s: s.config.sparse is not None and s.world > 1,
             "block-sparse attention is not available across several processes yet"),
    Conflict("batch-invariant+native", lambda s: s.config.batch_invariant and s.native,
             "batch_invariant applies to the planned path (the native path is the published forward, with "
             "PyTorch's kernels): drop native=True (--native) or batch_invariant"),
    Conflict("batch-invariant+fp8", lambda s: s.config.batch_invariant and _any_fp8(s.config.precision),
             "batch_invariant has no FP8 matrix product yet (FP8's scaled GEMM is the library's): use 16-bit "
             "weights or drop batch_invariant"),
    Conflict("batch-invariant+sparse", lambda s: s.config.batch_invariant and s.config.sparse is not None,
             "batch_invariant has no block-sparse attention kernel yet: drop sparse or batch_invariant"),
    Conflict("batch-invariant+processes", lambda s: s.config.batch_invariant and s.world > 1,
             "batch_invariant runs on one process (the ring attention merges in a rank-dependent order): drop "
             "--gpus"),
    Conflict("tensor+native", lambda s: s.native and s.tensor > 1,
             "the native path runs on one process: use the planned path (the default) under tensor parallelism, "
             "or run the native path without --gpus"),
    Conflict("draws+tensor", lambda s: s.tensor > 1 and s.gen.seed is None and s.draws,
             "across several processes pass seed=N, so that every process draws the same random numbers (the "
             "command line always does: --seed, default 0)"),
    Conflict("tensor+sparse", lambda s: s.tensor > 1 and s.config.sparse is not None,
             "block-sparse attention is not available under tensor parallelism yet: drop sparse or use "
             "parallel: sequence"),
    Conflict("tensor+offload", lambda s: s.tensor > 1 and s.config.offload != "off",
             "offload is not available under tensor parallelism yet (each rank holds 1/K of the layer weights "
             "already): use offload: off"),
    Conflict("tensor+fp8", lambda s: s.tensor > 1 and _any_fp8(s.config.precision),
             "FP8 weights are not available under tensor parallelism yet (the per-channel scales of the "
             "row-parallel o and down projections would be per shard): use 16-bit weights or one process"),
    Conflict("invariant+moe_kernel",
             lambda s: s.config.batch_invariant and s.config.moe_kernel in ("grouped", "triton"),
             "batch_invariant runs the MoE experts one at a time with its fixed-tile products; the grouped and "
             "Triton expert kernels pick their tiles by the row count: drop moe_kernel (auto) or batch_invariant"),
    Conflict("speculate+native", lambda s: s.gen.speculate > 0 and s.native,
             "self-speculative decoding (speculate > 0) verifies on the planned path only: drop native=True "
             "(--native)"),
    Conflict("speculate+processes", lambda s: s.gen.speculate > 0 and s.world > 1,
             "self-speculative decoding (speculate > 0) runs on one process (no sequence parallelism yet): drop "
             "--gpus or set speculate 0"),
    Conflict("constraint+native", lambda s: s.constrained and s.native,
             "an output constraint (json_schema, regex, choice, response_format, tools) runs on the planned path "
             "(its masks apply to the rows a step may commit): drop native=True (--native)"),
    Conflict("constraint+speculate", lambda s: s.constrained and s.gen.speculate > 0,
             "an output constraint changes which positions a step commits; self-speculative decoding (speculate "
             "> 0) reproduces the unconstrained steps: use one or the other"),
    Conflict("constraint+origin", lambda s: s.constrained and s.family == "dream" and s.gen.alg == "origin",
             "an output constraint commits from the answer's next free position; Dream's alg 'origin' unmasks "
             "random positions: use alg 'maskgit_plus', 'topk_margin' or 'entropy'"),
    Conflict("constraint+editing", lambda s: s.constrained and s.gen.editing_threshold is not None,
             "an output constraint keeps the committed answer a prefix its grammar accepts; LLaDA2.1's sampler "
             "(editing_threshold, which a LLaDA2.1 checkpoint's own generate() sets by default) rewrites committed "
             "tokens: structured output runs with LLaDA2.0's sampler only"),
    Conflict("constraint+processes", lambda s: s.constrained and (s.world > 1 or s.tensor > 1),
             "an output constraint runs on one process (its token masks are decided on the host per row): drop "
             "--gpus"),
    Conflict("speculate+sparse", lambda s: s.gen.speculate > 0 and s.config.sparse is not None,
             "self-speculative decoding (speculate > 0) reproduces the dense step-by-step tokens; block-sparse "
             "attention changes them: use one or the other"),
)


def _any_fp8(precision) -> bool:
    """Whether a PrecisionConfig may put any weights in FP8 (auto, an fp8 range, the embedding)."""
    return precision is not None and (precision.auto or precision.embed == "fp8"
                                      or any(r.dtype == "fp8" for r in precision.ranges))


def refuse(setting: Setting) -> None:
    """InputError with the first conflict's text (module docstring), before any work starts."""
    for c in CONFLICTS:
        if c.when(setting):
            raise InputError(c.message)


def refuse_config(config: EngineConfig, family: str = "", blocks: bool = False, procs: int = 1) -> None:
    """InputError when the engine's own options conflict, whatever a request asks (batch_invariant
    with native, FP8 or sparse; streamed K/V with sparse; ...): checked when the engine is built
    (family "" before the model is loaded, then with its family), so that `mosaic serve` does not
    start and refuse every request. procs: the processes of the launch (sequence parallel, or
    tensor parallel with parallel: tensor). A request's options add to this (refuse, per request)."""
    tp = config.parallel == "tensor" and procs > 1
    refuse(Setting(config, GenerationConfig(), family, config.native, 1 if tp else procs, blocks=blocks,
                   tensor=procs if tp else 1))


def check_plan(kv_tier: str | None, world: int, offload) -> None:
    """The combinations `mosaic plan` refuses (a block cache plans for one GPU, beside resident
    or offloaded weights but not streamed K/V)."""
    if kv_tier is not None and world > 1:
        raise InputError("a block cache is planned for one GPU only (no sequence parallelism yet)")
    if kv_tier is not None and offload is not None and offload.kv:
        raise InputError("a block cache keeps its K/V in its own store (kv_tier): plan it with offload "
                         "weights or resident, not weights+kv")


def engine_labels(config: EngineConfig, model, offload=None, world: int = 1) -> list[str]:
    """Engine options of the planned path that may change tokens relative to the reference
    (offload: the request's graph.streams.Offload; streamed K/V changes the rounding)."""
    out = []
    if config.attention != "sdpa":
        out.append(f"attention={config.attention}: its bf16 rounding may differ from PyTorch's SDPA order")
    if config.sparse is not None:
        out.append(sparse_label(config.sparse))
    if config.moe_kernel == "triton" and model is not None and model.cfg.num_experts:
        out.append(MOE_TRITON_LABEL)
    if config.fused_projections == "all":
        out.append(FUSED_ALL_LABEL)
    if model is not None and model.quantized:
        out.append(fp8_label(model))
    if offload is not None and offload.kv:
        out.append("K/V streamed from host memory: attention merged over key blocks in fp32 "
                   "(exact softmax; rounding differs from one SDPA call)")
    return out


FUSED_ALL_LABEL = ("fused_projections=all: a block step's q, k and v projections run as one GEMM, whose rounding "
                   "may differ from three (cuBLAS picks other kernels for the wider product), and its RMSNorms run "
                   "in one pass (one launch each where Triton runs), whose fp32 sum of squares is in a fixed order "
                   "that differs from PyTorch's mean: tokens may differ from the default")
MOE_TRITON_LABEL = ("moe_kernel=triton: the routed experts' products in Mosaic's fused Triton kernel, whose "
                    "summation order differs from the library GEMMs' (low-precision rounding may change tokens)")
SPECULATE_LABEL = ("speculate on CUDA without batch_invariant: each verification runs several canvases in one "
                   "forward, whose library GEMMs may round differently from a one-canvas step (bf16 ties); "
                   "batch_invariant=True gives the step-by-step tokens")


def sparse_label(sparse) -> str:
    rs = ", ".join(f"layers {r.layers[0]}-{r.layers[1]} {r.pattern}" + (f" keep {r.keep:g}" if r.pattern == "topk"
                                                                        else "") for r in sparse.ranges)
    return f"block-sparse attention after {sparse.dense_steps} dense steps ({rs}; {sparse.estimate} block estimate)"


def fp8_label(model) -> str:
    fp8 = ", ".join(str(a) if a == b else f"{a}-{b}" for (a, b) in
                    (r["layers"] for r in ranges(model.precision) if r["dtype"] == FP8_NAME))
    emb = " and the embedding (per-row scales)" if "embed_scale" in model.extra else ""
    return f"FP8 weights in layers {fp8 or 'none'}{emb} (e4m3, per-channel weight scales, per-token activation scales)"


def batched_label(kernel: str) -> str | None:
    """What a batched block step's attention kernel (kernels/varlen.py) says when it ran for a
    request: None for the loop (each sequence's own call, as alone) and for Mosaic's Triton
    varlen kernel (batch-invariant, and the request's block steps alone run it too)."""
    if kernel in ("loop", "triton"):
        return None
    return (f"batched attention ({kernel} varlen over every sequence of a step): its rounding differs from one "
            "attention call per sequence, so tokens may differ from the request alone; batch_invariant=True "
            "gives the tokens alone")


def lossy_labels(setting: Setting, model, sampler, offload=None, batched_kernels=()) -> list[str]:
    """Every label of a request: its sampler's, the engine options' (planned path), several
    low-precision processes' (their reductions split differently), and the batched attention
    kernels its steps ran with (batched_kernels: their names, kernels/varlen.py)."""
    dev = torch.device(setting.device_type)
    out = sampler.lossy_labels(setting.gen, dev, setting.native)
    out += [lab for lab in map(batched_label, sorted(batched_kernels)) if lab is not None]
    if not setting.native:
        out += engine_labels(setting.config, model, offload, setting.world)
        if setting.gen.speculate > 0 and dev.type == "cuda" and not setting.config.batch_invariant:
            out.append(SPECULATE_LABEL)
    if setting.world > 1 and model is not None and model.dtype != torch.float32:
        out.append(PARALLEL_LABEL)
    if setting.tensor > 1 and model is not None and model.dtype != torch.float32:
        out.append(TENSOR_LABEL)
    return out
