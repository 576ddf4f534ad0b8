"""What an engine checks and sets once at construction: kernel choices the device can run,
sparse ranges the model has, and (on a CPU) torch's thread count; and what a request is warned
about (speculation where it is known to be slower)."""

from __future__ import annotations

import os
import warnings

import torch

from .. import kernels
from ..config import EngineConfig, GenerationConfig
from ..errors import InputError, MemoryBudgetError, gib


def check_sparse_layers(sparse, model) -> None:
    """InputError when a sparse range names a layer the model does not have (engine and plan)."""
    top = max((r.layers[1] for r in sparse.ranges), default=-1) if sparse is not None else -1
    if top >= model.cfg.num_layers:
        raise InputError(f"sparse ranges reach layer {top}, but {model.name} has layers 0-{model.cfg.num_layers - 1}")


def check_kernels(cfg: EngineConfig, device: torch.device, dtype: torch.dtype = torch.float32,
                  model_cfg=None) -> None:
    """An impossible kernel choice for this device fails at construction (InputError). model_cfg:
    the model's ModelConfig (its heads for a named varlen_kernel, its widths for a MoE model's
    moe_kernel); None checks only the choices that do not depend on the model."""
    for option in ("logits_kernel", "elementwise_kernel"):
        kernels.want_triton(device.type, getattr(cfg, option), option)
    if model_cfg is not None and model_cfg.num_experts:   # a MoE model: its hidden and expert widths
        kernels.moe_kernel(device.type, dtype, cfg.moe_kernel, cfg.batch_invariant, (model_cfg.hidden, model_cfg.ffn))
    if model_cfg is not None and cfg.varlen_kernel != "auto":   # 'auto' always finds one
        kernels.varlen_kernel(device.type, dtype, model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim,
                              cfg.batch_invariant, cfg.varlen_kernel)
    if cfg.attention == "triton":   # Mosaic's attention kernel: CUDA (or the CPU interpreter)
        kernels.want_triton(device.type, "triton", "attention")
    if cfg.attention == "cudnn" and device.type != "cuda":
        raise InputError(f"attention 'cudnn' needs a CUDA device (here: {device.type}); on a CPU attention "
                         "is PyTorch's SDPA: use attention='sdpa' (the default)")


SMALL_MODEL_BYTES = 256 * 2**20   # below this a CPU step is too short for intra-op threads to pay


def set_threads(threads: int | None, model) -> None:
    """torch's intra-op threads on a CPU (a process-wide setting): `threads` if given, else one
    for a small model. On a busy 2-core machine the bundled model's 8 steps took 10.1 s with
    PyTorch's default two threads and 0.40 s with one (threads spinning against other load).
    More threads than the process's cores (os.sched_getaffinity, else os.cpu_count) are set as
    asked, with one warning: they compete for the cores (--threads 1000 on 2 cores ran ~200x
    slower)."""
    if model.device.type != "cpu":
        return
    cores = usable_cores()
    if threads is not None and cores and threads > cores:
        warnings.warn(f"threads={threads} (--threads) is more than the {cores} CPU core(s) this process can use: "
                      f"the extra threads compete for them and every step slows down; give at most {cores}",
                      UserWarning, stacklevel=3)
    if threads is None and model.weight_bytes() < SMALL_MODEL_BYTES:
        threads = 1
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def usable_cores() -> int | None:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def check_max_length(engine, length: int) -> None:
    """max_seq_len (max_length) must fit the budget: a request of that many tokens whose canvas
    is the default max_new_tokens (at most half of it) is admitted by `engine`, or this raises
    MemoryBudgetError with the longest that fits."""
    default = engine.generation_config().max_new_tokens

    def gen_for(n: int) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=max(1, min(default, n // 2)))
    try:
        engine.admit(1, length, gen_for(length))
    except MemoryBudgetError as e:
        best = engine.admitter.longest(1, gen_for, length, unit=1)
        raise MemoryBudgetError(
            f"max_seq_len {length:,} does not fit the memory budget ({gib(e.budget_bytes)}): a request of "
            f"{length:,} tokens needs at least {gib(e.needed_bytes)}; longest that fits: {best:,} "
            f"tokens", needed_bytes=e.needed_bytes, budget_bytes=e.budget_bytes, max_tokens=best) from None


# Rows per canvas past which a GPU forward is compute-bound: an H200 does ~990 TFLOP/s of bf16
# matrix work against 4.8 TB/s of weight reads, ~200 FLOP per weight byte, and a row costs 1
# FLOP per weight byte (2 per 2-byte weight), so past ~200 rows a step's time grows with its
# rows and a verification of K canvases costs about K steps (docs/MODELS.md).
COMPUTE_BOUND_ROWS = 256


class SpeculationWarning(UserWarning):
    """Self-speculative decoding where it is expected to be slower than step by step (it stays
    exact: the same tokens)."""


def speculation_slower(device_type: str, positions: int, k: int) -> str | None:
    """Why speculate=k on canvases of `positions` rows is expected slower than step by step on
    this device, or None. On a GPU past COMPUTE_BOUND_ROWS a verification of k canvases costs
    ~k steps and commits at most k tokens (H200, llada-8b preset, 1k + 256 tokens, k = 4: 130 ms
    per verification for 1.45 tokens, 11.2 vs 28.3 tokens/s step by step, as reported in the
    issue that asked for this warning). On a CPU the bundled models gain (bench/results/
    speculative_cpu.json: 0.89x / 0.80x the step-by-step seconds at k = 4); not measured beyond."""
    if k <= 0 or device_type != "cuda" or positions <= COMPUTE_BOUND_ROWS:
        return None
    return (f"speculate={k} on a {positions}-position canvas: past ~{COMPUTE_BOUND_ROWS} rows a GPU step is "
            f"compute-bound, so a verification of {k} canvases costs about {k} steps and commits at most {k} "
            "tokens: expected slower than step by step (same tokens; docs/MODELS.md)")
