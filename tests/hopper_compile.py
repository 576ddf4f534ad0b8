"""Run a compile check for an H100/H200 (sm_90) on a machine without a GPU: Triton's front end and
its bundled ptxas, in a subprocess without TRITON_INTERPRET (the interpreter replaces the
kernels such a check compiles). Skips the calling test where this Triton bundles no NVIDIA
toolchain. Used by the kernel tests that lower a kernel for Hopper (tools/*_compile_check.py,
tests/kernels/test_compile_hopper.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_for_hopper(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`python *args` from the repository root (PYTHONPATH=root, no TRITON_INTERPRET, Triton's
    default FP fusion on unless set): its completed process, output captured as text."""
    import triton
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin").is_dir():
        pytest.skip("this Triton has no bundled NVIDIA toolchain")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=ROOT)
