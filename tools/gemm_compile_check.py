"""Compile every tile of the batch-invariant matmul (mosaic/kernels/invariant_tiles.TILES) for an
H100/H200 (sm_90a) on a machine without a GPU: Triton's own front end and bundled ptxas, no driver.

    python tools/gemm_compile_check.py          # no TRITON_INTERPRET in the environment

Prints per tile and dtype: shared memory bytes, registers and spills (ptxas -v), and the MMA
instructions of the K loop. A row's bits are the same under every tile only if every tile sums an
element's products with one instruction family (invariant_tiles.py): 16-bit tiles must lower to
wgmma k16 steps and no mma.sync, fp32 (IEEE) to FMAs. Exits 1 if a tile fails to compile, spills,
overflows the 227 KiB of shared memory or lowers to another family."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: the interpreter replaces the kernels this tool compiles")

import torch  # noqa: E402
import triton  # noqa: E402
from attention_compile_check import ptxas_info  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mosaic.kernels.invariant_tiles import Tile, all_tiles  # noqa: E402
from mosaic.kernels.invariant_triton import GROUP_M, _matmul  # noqa: E402

CONSTANTS = ("HAS_BIAS", "IEEE", "BM", "BN", "BK", "GROUP")
ALIGNED = ("X", "W", "OUT", "N", "K", "stride_x", "stride_w", "stride_o")   # as Triton infers at launch
SMEM = 227 * 1024     # bytes of shared memory a Hopper block may use
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def compile_sm90(dtype: torch.dtype, t: Tile, bias: bool = False):
    names = _matmul.arg_names
    sig = {n: "constexpr" if n in CONSTANTS else "*" + NAMES[dtype] if n in ("X", "W", "B", "OUT") else "i32"
           for n in names}
    const = dict(HAS_BIAS=bias, IEEE=dtype == torch.float32, BM=t.bm, BN=t.bn, BK=t.bk, GROUP=GROUP_M)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED}
    return triton.compile(ASTSource(_matmul, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": t.warps, "num_stages": t.stages})


def check(dtype: torch.dtype, t: Tile) -> tuple[str, list[str]]:
    """(one line of facts, what is wrong with it) for one tile."""
    k = compile_sm90(dtype, t)
    ptx = k.asm["ptx"]
    wgmma = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
    mma = sorted(set(re.findall(r"\bmma\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
    fma = len(re.findall(r"\bfma\.rn\.f32", ptx))
    info = ptxas_info(ptx)
    wrong = []
    if dtype == torch.float32:
        if wgmma or mma or not fma:
            wrong.append("fp32 IEEE dot is not FMAs")
    elif mma or not wgmma or any(not s.endswith("k16") for s in wgmma):
        wrong.append("not wgmma k16 alone")
    if k.metadata.shared > SMEM:
        wrong.append(f"shared {k.metadata.shared} B > {SMEM}")
    if re.search(r"[1-9]\d* bytes spill", info):
        wrong.append("spills")
    line = (f"{NAMES[dtype]} {t.bm}x{t.bn}x{t.bk} w{t.warps} s{t.stages}: shared {k.metadata.shared} B, {info}; "
            f"wgmma {wgmma} mma.sync {mma} fma {fma}")
    return line, wrong


def main() -> int:
    failed = 0
    for dtype in (torch.bfloat16, torch.float32):
        for t in all_tiles(dtype):
            try:
                line, wrong = check(dtype, t)
            except Exception as e:  # noqa: BLE001
                line, wrong = f"{NAMES[dtype]} {t}", [f"{type(e).__name__}: {str(e)[:400]}"]
            failed += bool(wrong)
            print(f"{'FAILED' if wrong else 'ok':<6} {line}{'  ' + '; '.join(wrong) if wrong else ''}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
