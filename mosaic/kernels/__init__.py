"""The one place that picks a kernel: Triton on CUDA where one exists, the PyTorch reference
otherwise. A setting comes from the engine config ('auto' | 'triton' | 'torch'); the environment
variable MOSAIC_KERNELS=torch|triton overrides 'auto' everywhere (tests force a path with it or
with the config). No state is kept here: every choice is a pure function of its arguments."""

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
    choice = setting if setting != "auto" else (os.environ.get("MOSAIC_KERNELS") or "auto")
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
    the loop with each sequence's invariant kernel. The environment variable
    MOSAIC_VARLEN=loop|flash|efficient|gather|triton overrides 'auto' (tests, benchmarks). Raises
    InputError when a named kernel cannot run these inputs here."""
    choice = setting if setting != "auto" else (os.environ.get("MOSAIC_VARLEN") or "auto")
    if choice == "auto":
        if device_type != "cuda":
            return "loop"
        order = ("triton", "loop") if batch_invariant else ("flash", "efficient", "loop")
        return next(k for k in order if varlen_available(k, device_type, dtype, hq, hkv, hd))
    if choice not in VARLEN_KERNELS:
        raise InputError(f"batched attention kernel {choice!r} is unknown; one of {', '.join(VARLEN_KERNELS)}")
    if batch_invariant and choice not in ("loop", "triton"):
        raise InputError(f"batched attention kernel {choice!r} is not batch-invariant; batch_invariant runs 'loop' "
                         "or 'triton'")
    if not varlen_available(choice, device_type, dtype, hq, hkv, hd):
        raise InputError(f"batched attention kernel {choice!r} cannot run {dtype} with {hq} query / {hkv} key heads "
                         f"of {hd} on {device_type}; use 'loop' or 'auto'")
    return choice
