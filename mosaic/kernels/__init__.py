"""The one place that picks a kernel: Triton on CUDA where one exists, the PyTorch reference
otherwise. A setting comes from the engine config ('auto' | 'triton' | 'torch'; tests force a
path with it). No state is kept here: every choice is a pure function of its arguments (the one
environment variable read is Triton's own TRITON_INTERPRET, which decides whether Triton runs on
a CPU at all)."""

from __future__ import annotations

import os

import torch

from ..errors import InputError


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def want_triton(device_type: str, setting: str = "auto", option: str = "logits_kernel") -> bool:
    """Triton on CUDA by default; on the CPU only under TRITON_INTERPRET=1 and when asked.

    Raises InputError when Triton is asked for where it cannot run."""
    choice = setting
    if choice == "torch":
        return False
    if choice == "triton":
        if not triton_available():
            raise InputError("the Triton kernel path was asked for, but triton is not installed "
                             "(pip install triton); use " + _alternatives(option))
        if device_type not in ("cuda", "meta") and not interpret():
            raise InputError(f"the Triton kernel path needs a CUDA device (here: {device_type}); on a "
                             "CPU it runs only under TRITON_INTERPRET=1; use " + _alternatives(option))
        return True
    return device_type == "cuda" and triton_available()


def rmsnorm_kernel(device_type: str, setting: str = "auto", invariant: bool = False, one_pass: bool = False) -> str:
    """The kernel of an RMSNorm (kernels/elementwise.rmsnorm), and so its scratch: 'one_pass'
    (rmsnorm_triton.py: one launch, no scratch, each row's squares summed in a fixed order) in
    batch-invariant mode on CUDA, and where Triton runs (want_triton: CUDA, or the interpreter
    when asked) in batch-invariant mode or when one_pass asks for it (a Fast-dLLM block step of
    a model fused with fused_projections 'all': models/fusion.one_pass_norms; labelled, as its
    order is not PyTorch's mean's); else 'triton' (elementwise_triton: the reference's bits,
    three launches over fp32 scratch) where Triton runs, else 'torch' (the reference, the same
    scratch). Raises InputError as want_triton does."""
    fast = want_triton(device_type, setting)
    if (invariant and device_type == "cuda") or ((invariant or one_pass) and fast):
        return "one_pass"
    return "triton" if fast else "torch"


MOE_KERNELS = ("auto", "loop", "grouped", "triton")


def moe_kernel(device_type: str, dtype: torch.dtype, setting: str = "auto", invariant: bool = False,
               widths: tuple[int, ...] = ()) -> str:
    """The routed experts' kernel (kernels/moe.py, moe_triton.py): 'loop' (the reference: one
    expert at a time, reads the group sizes on the host), 'grouped' (torch._grouped_mm over rows
    sorted by expert: no host sync, the loop's bits) or 'triton' (Mosaic's fused kernel: no host
    sync, its own summation order: lossy, opt-in). setting (the engine's moe_kernel, --moe-kernel)
    'auto': 'loop' in batch-invariant mode (its row-invariant products) and where grouped_mm would sync
    (CUDA in a dtype other than bfloat16, or a GPU before sm90: aten's fallback copies the group
    offsets to the host; or widths, the hidden and expert FFN widths, whose rows are not a
    multiple of 16 bytes: aten checks it on every device), else 'grouped'.

    Raises InputError when the setting cannot run here."""
    choice = setting
    if choice not in MOE_KERNELS:
        raise InputError(f"moe_kernel={choice!r}: use one of {', '.join(MOE_KERNELS)}")
    if choice == "triton":
        want_triton(device_type, "triton", "moe_kernel")
        return choice
    if choice == "loop" or (choice == "auto" and invariant):
        return "loop"
    # meta tensors: aten's meta kernel checks the CUDA fast path's dtypes (a CUDA plan's device)
    grouped_ok = hasattr(torch, "_grouped_mm") and all(w * dtype.itemsize % 16 == 0 for w in widths) and (
        device_type not in ("cuda", "meta") or _grouped_fast(dtype))
    if choice == "grouped" and not grouped_ok:
        raise InputError("moe_kernel='grouped' needs torch._grouped_mm without a host sync: torch >= 2.8, on CUDA "
                         "bfloat16 on sm90 / sm100, rows of whole 16 bytes (here: "
                         f"{device_type}, {dtype}, widths {widths}); use moe_kernel='auto' (the expert loop "
                         "there) or 'triton'")
    return "grouped" if grouped_ok else "loop"


def _grouped_fast(dtype: torch.dtype) -> bool:
    """torch._grouped_mm's CUDA fast path (CUTLASS, no host sync): bf16 in and out on sm90 /
    sm100 (aten GroupedBlas.cpp). A machine without CUDA planning for one assumes it."""
    if dtype != torch.bfloat16:
        return False
    if not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability()[0] in (9, 10)


def _alternatives(option: str) -> str:
    return "attention='sdpa'" if option == "attention" else f"{option}='auto' or 'torch'"


def prefer_cudnn_attention(device: torch.device, dtype: torch.dtype, head_dim: int, max_numel: int,
                           setting: str = "sdpa") -> bool:
    """Opt-in (setting='cudnn'): cuDNN's fused attention before FlashAttention-2 (PyTorch's first
    choice) on Hopper only, where the kernel alone is faster (`python -m bench sdpa` on the H200: 1.6
    vs 3.1 ms at 8k and 27 vs 50 ms at 32k tokens, 32 heads of 128), for bf16/fp16 with head dim
    64 or 128, and only for tensors under 2^31 elements. Its bf16 rounding differs from the
    reference's kernel, so it is off by default."""
    return (setting == "cudnn" and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and head_dim in (64, 128) and max_numel < 2**31
            and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] == 9)


VARLEN_KERNELS = ("loop", "flash", "efficient", "gather", "triton")


def _has_arg(op, name: str) -> bool:
    try:
        return any(a.name == name for a in op.default._schema.arguments)
    except (AttributeError, RuntimeError):
        return False


def varlen_available(kernel: str, device_type: str, dtype: torch.dtype, hq: int, hkv: int, hd: int) -> bool:
    """Whether a batched attention kernel (kernels/varlen.py) runs these inputs here: the loop
    everywhere; flash on CUDA (sm80+, built with FlashAttention, an op that takes seqused_k) for
    bf16 / fp16 with head dims 8..256 in steps of 8; efficient on CUDA with seqlen_k for equal
    query and key heads."""
    if kernel in ("loop", "gather"):
        return True
    if kernel == "triton":     # CUDA, or the CPU under TRITON_INTERPRET=1 (tests)
        return triton_available() and hd <= 256 and hq % hkv == 0 and (
            (device_type == "cuda" and torch.cuda.is_available()) or (device_type == "cpu" and interpret()))
    if device_type != "cuda" or not torch.cuda.is_available():
        return False
    if kernel == "flash":
        built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
        return (built and dtype in (torch.bfloat16, torch.float16) and hd % 8 == 0 and hd <= 256 and hq % hkv == 0
                and torch.cuda.get_device_capability()[0] >= 8
                and _has_arg(torch.ops.aten._flash_attention_forward, "seqused_k"))
    if kernel == "efficient":
        return hq == hkv and hd % 8 == 0 and _has_arg(torch.ops.aten._efficient_attention_forward, "seqlen_k")
    return False


def varlen_kernel(device_type: str, dtype: torch.dtype, hq: int, hkv: int, hd: int,
                  batch_invariant: bool = False, setting: str = "auto") -> str:
    """The kernel of a batched step's attention over every sequence (kernels/varlen.py).

    'auto': the loop (one call per sequence: the CPU path and the oracle) on the CPU; on CUDA
    flash, else efficient, else the loop; in batch-invariant mode on CUDA Mosaic's Triton varlen
    kernel (batch-invariant by construction, and a request's block steps alone run it too), else
    the loop with each sequence's invariant kernel. setting (the engine's varlen_kernel,
    --varlen-kernel): 'auto' or one of VARLEN_KERNELS, which tests and benchmarks use to force a
    path. Raises InputError for an unknown name, a kernel that is not batch-invariant in that
    mode, or one that cannot run these inputs here."""
    if setting == "auto":
        if device_type != "cuda":
            return "loop"
        order = ("triton", "loop") if batch_invariant else ("flash", "efficient", "loop")
        return next(k for k in order if varlen_available(k, device_type, dtype, hq, hkv, hd))
    if setting not in VARLEN_KERNELS:
        raise InputError(f"varlen_kernel={setting!r}: batched attention kernel unknown; use 'auto' or one of "
                         f"{', '.join(VARLEN_KERNELS)}")
    if batch_invariant and setting not in ("loop", "triton"):
        raise InputError(f"varlen_kernel={setting!r}: batched attention kernel {setting!r} is not batch-invariant; "
                         "batch_invariant runs 'loop' or 'triton' (or 'auto')")
    if not varlen_available(setting, device_type, dtype, hq, hkv, hd):
        raise InputError(f"varlen_kernel={setting!r}: batched attention kernel {setting!r} cannot run {dtype} with "
                         f"{hq} query / {hkv} key heads of {hd} on {device_type}; use 'loop' or 'auto'")
    return setting
