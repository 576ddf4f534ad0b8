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
