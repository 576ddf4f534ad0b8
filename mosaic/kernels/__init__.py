"""The one place that picks a kernel: Triton on CUDA where one exists, the PyTorch reference
otherwise. Tests force a path with `use("torch")` / `use("triton")` or MOSAIC_KERNELS."""

from __future__ import annotations

import os

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
