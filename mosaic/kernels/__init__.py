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


_cudnn_broken = False


def prefer_cudnn_attention(q: torch.Tensor, k: torch.Tensor, setting: str = "auto") -> bool:
    """cuDNN's fused attention before FlashAttention-2 (PyTorch's first choice) on Hopper only,
    where it is the faster kernel (on Ampere and Blackwell it is not), and only for tensors under
    2^31 elements: the long-context sizes DESIGN.md verified run on flash. The reference's order
    stays available as setting='sdpa'; outputs differ from it in bf16 rounding only."""
    if setting == "sdpa" or _cudnn_broken or q.device.type != "cuda":
        return False
    if max(q.numel(), k.numel()) >= 2**31:
        return False
    return torch.cuda.get_device_capability(q.device)[0] == 9


def cudnn_attention_failed() -> None:
    global _cudnn_broken
    _cudnn_broken = True
