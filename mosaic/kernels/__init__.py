"""The one place that picks a kernel: Triton on CUDA where one exists, the PyTorch reference
otherwise. Tests force a path with `use("torch")` / `use("triton")` or MOSAIC_KERNELS."""

from __future__ import annotations

import os

import torch

_forced: str | None = os.environ.get("MOSAIC_KERNELS") or None


def use(path: str | None) -> None:
    """'torch', 'triton' or None (automatic)."""
    global _forced
    assert path in (None, "torch", "triton"), path
    _forced = path


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def want_triton(device_type: str, setting: str = "auto") -> bool:
    """Triton on CUDA by default; on the CPU only under TRITON_INTERPRET=1 and when asked."""
    choice = _forced or setting
    if choice == "torch":
        return False
    if choice == "triton":
        if not triton_available():
            raise RuntimeError("the Triton kernel path was forced but triton is not installed")
        if device_type != "cuda" and not interpret():
            raise RuntimeError("the Triton kernel path on the CPU needs TRITON_INTERPRET=1")
        return True
    return device_type == "cuda" and triton_available()


# (dtype, head dim) -> the error cuDNN raised for it: that combination keeps PyTorch's order
cudnn_failures: dict[tuple, str] = {}
attention_calls = {"cudnn": 0, "sdpa": 0}   # which order each attention call asked for


def prefer_cudnn_attention(device: torch.device, dtype: torch.dtype, head_dim: int, max_numel: int,
                           setting: str = "sdpa") -> bool:
    """Opt-in (setting='cudnn'): cuDNN's fused attention before FlashAttention-2 (PyTorch's first
    choice) on Hopper only, where the kernel alone is faster (bench/sdpa_probe.py on the H200: 1.6
    vs 3.1 ms at 8k and 27 vs 50 ms at 32k tokens, 32 heads of 128; on Ampere and Blackwell it is
    not), for bf16/fp16 with head dim 64 or 128, and only for tensors under 2^31 elements: the
    long-context sizes DESIGN.md verified run on flash. Its bf16 rounding differs from the
    reference's kernel, so it is off by default; the step-level gain is not measured yet."""
    return (setting == "cudnn" and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and head_dim in (64, 128) and (dtype, head_dim) not in cudnn_failures and max_numel < 2**31
            and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] == 9)


def cudnn_attention_failed(q: torch.Tensor, error: Exception) -> None:
    cudnn_failures[(q.dtype, q.shape[-1])] = str(error)[:500]
