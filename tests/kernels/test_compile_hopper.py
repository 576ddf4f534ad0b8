"""Triton kernels that the CPU's interpreter runs but the GPU compiler could refuse: lowered for
sm_90 by Triton's bundled toolchain (no GPU, no driver). The interpreter is plain Python, so a
name typed differently in an if's two branches passed every CPU test while the H200 raised a
CompilationError on the first fused q|k|v block step (bench everyday --part profile_all)."""

from __future__ import annotations

from hopper_compile import run_for_hopper

QKV = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mosaic.kernels.elementwise_triton import _qkv_kernel as fn
ptr = {"QKV": "*bf16", "KO": "*bf16", "VO": "*bf16", "C": "*fp32", "S": "*fp32"}
for f32 in (False, True):
    const = {"F32": f32, "BR": 32, "BH": 64, "BD": 128}     # LLaDA-8B: hd 128, half 64
    sig = {n: "constexpr" if n in const else ptr.get(n, "i32") for n in fn.arg_names}
    triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print("compiled")
"""


def test_the_fused_qkv_kernel_compiles_for_hopper():
    r = run_for_hopper(["-c", QKV])
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-2000:]
