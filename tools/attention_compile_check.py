"""Compile the attention kernel for an H100/H200 (sm_90a) on a machine without a GPU: Triton's
own front end and bundled ptxas, no driver. Catches what the interpreter cannot (GPU-only
lowering errors, shared-memory overflow, register spills) before any GPU time is spent.

    python tools/attention_compile_check.py [--quick]     # no TRITON_INTERPRET in the environment

Prints per variant: shared memory bytes, registers and spills (ptxas -v), and whether the loop
uses wgmma, cp.async and TMA bulk copies. Exits 1 if any variant fails to compile."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: the interpreter replaces the kernels this tool compiles")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mosaic.kernels.attention_triton import _attn_fwd  # noqa: E402

POINTERS = {"Q": "x", "K": "x", "V": "x", "Out": "x", "Lse": "fp32", "WsO": "fp32", "WsL": "fp32",
            "Indptr": "i32", "Indices": "i32"}
ALIGNED = ["Q", "K", "V", "Out", "stride_qm", "stride_qh", "stride_kn", "stride_kh", "stride_vn", "stride_vh",
           "stride_om", "stride_oh"]     # what Triton infers at launch for 16-aligned planned buffers


def compile_sm90(dtype="bf16", hd=128, block_d=None, bm=128, bn=64, warps=8, stages=3, layout=0, tma=False,
                 split=False, g=1):
    names = _attn_fwd.arg_names
    sig, const = {}, {}
    for n in names:
        if n in POINTERS:
            sig[n] = "*" + (dtype if POINTERS[n] == "x" else POINTERS[n])
        elif n in ("desc_k", "desc_v"):
            sig[n] = f"tensordesc<{dtype}[{bn}, {hd}]>" if tma else "constexpr"
            if not tma:
                const[n] = None
        elif n == "sm_scale":
            sig[n] = "fp32"
        elif n.isupper() or n.startswith("BLOCK") or n == "G":
            sig[n] = "constexpr"
        else:
            sig[n] = "i32"
    const.update(HEAD_DIM=hd, BLOCK_D=block_d or hd, G=g, LAYOUT_BQ=layout, LAYOUT_BK=layout, LAYOUT_DIV=1,
                 WRITE_LSE=True, SPLIT=split, TMA=tma, IEEE=dtype == "fp32", WS=False, BLOCK_M=bm, BLOCK_N=bn)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED}
    return triton.compile(ASTSource(_attn_fwd, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def ptxas_info(ptx: str) -> str:
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for exe in ("ptxas-blackwell", "ptxas"):   # the newer one reads the PTX version Triton writes
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "k.ptx"
            src.write_text(ptx)
            r = subprocess.run([str(bindir / exe), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(d) / "k.o")],
                               capture_output=True, text=True)
        if r.returncode == 0:
            lines = [x.split("info    : ")[-1] for x in r.stderr.splitlines() if "registers" in x or "spill" in x]
            return "; ".join(x.strip() for x in lines)
    return "ptxas -v unavailable"


VARIANTS = {
    "dense bf16 128x64 s3": {},
    "dense bf16 128x128 s2": dict(bn=128, stages=2),
    "dense bf16 tma": dict(tma=True),
    "sparse 128 bf16": dict(layout=128),
    "sparse 128 tma": dict(layout=128, tma=True),
    "split-K": dict(split=True),
    "dream G=7": dict(g=7),
    "hd 8 padded (tiny models)": dict(hd=8, block_d=16, bm=64, bn=64, warps=4),
    "fp32 ieee": dict(dtype="fp32", bm=64, bn=32, warps=4, stages=2),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="two variants: dense and sparse with TMA")
    names = ["dense bf16 128x64 s3", "sparse 128 tma"] if ap.parse_args().quick else list(VARIANTS)
    failed = 0
    for name in names:
        try:
            k = compile_sm90(**VARIANTS[name])
            ptx = k.asm["ptx"]
            print(f"{name:<28} ok  shared {k.metadata.shared:>6} B  {ptxas_info(ptx)}  wgmma {'wgmma' in ptx}  "
                  f"cp.async {'cp.async.cg' in ptx or 'cp.async.ca' in ptx}  tma {'cp.async.bulk.tensor' in ptx}",
                  flush=True)
        except Exception as e:
            failed += 1
            print(f"{name:<28} FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
