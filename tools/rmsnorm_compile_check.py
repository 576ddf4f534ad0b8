"""Compile RMSNorm's one-pass kernel (mosaic/kernels/rmsnorm_triton.py) and the composed path's
row mean (invariant_triton._row_mean) for an H100/H200 (sm_90) on a machine without a GPU
(Triton's front end and bundled ptxas, no driver), and check that the one pass sums a row's
squares as the row mean does: the same register layout of the tensor tl.sum reduces (4 values a
thread x 32 threads x 4 warps at d = 4096), the same reduction instructions in the same order
(the in-thread tree, the warp shuffles, the cross-warp step through shared memory), and the
same division of the sum by d. The bits themselves: tests/gpu/test_rmsnorm_gpu.py.

    python tools/rmsnorm_compile_check.py        # no TRITON_INTERPRET in the environment

Prints one line per dtype and add / no add; exits 1 if any differs."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: the interpreter replaces the kernels this tool compiles")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mosaic.kernels.elementwise_triton import OPTS  # noqa: E402
from mosaic.kernels.invariant_triton import ROW_BLOCK, ROW_WARPS, _row_mean  # noqa: E402
from mosaic.kernels.rmsnorm_triton import VEC, _rmsnorm_rows  # noqa: E402

POINTERS = ("X", "A", "W", "OUT")
REDUCE = re.compile(r"^\s*(add(?:\.rn)?\.f32|shfl\.sync\.bfly\.b32|st\.shared\.b32|ld\.shared\.b32|bar\.sync)\b(.*)$")


def compile_sm90(fn, types: dict, const: dict, aligned, **opts):
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}   # as a launch at d = 4096
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": ROW_WARPS, **opts})


def reduce_layouts(ttgir: str) -> tuple[str, str]:
    """The layouts tl.sum's reshape takes the squares from and to."""
    defs = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<.*>)$", ttgir, re.M))
    m = re.search(r"tt\.reshape %\S+ allow_reorder : tensor<\d+xf32, (#\w+)> -> tensor<\d+xf32, (#\w+)>", ttgir)
    return defs[m.group(1)], defs[m.group(2)]


def reduction(ptx: str) -> list[str]:
    """The first loop's reduction, from the barrier before tl.sum (the residual's fp32 adds come
    before it) to the loop's end, registers renamed in order of appearance (the fp32 add's
    rounding suffix dropped: .rn is the default mode, written where fp fusion is off)."""
    body = ptx[ptx.index("$L__BB0_2:"):]
    body = body[body.index("bar.sync"):body.index("bra")]
    names: dict[str, str] = {}
    out = []
    for line in body.splitlines():
        m = REDUCE.match(line)
        if m:
            args = re.sub(r"%r\d+", lambda r: names.setdefault(r.group(0), f"v{len(names)}"), m.group(2))
            out.append(m.group(1).replace(".rn", "") + " " + " ".join(args.split()))
    return out


def main() -> int:
    ref = compile_sm90(_row_mean, {"X": "*fp32", "OUT": "*fp32"}, {"BLOCK": ROW_BLOCK},
                       ("X", "OUT", "d", "stride_x"))
    want = (reduce_layouts(ref.asm["ttgir"]), reduction(ref.asm["ptx"]))
    failed = 0
    for dt in ("bf16", "fp16", "fp32"):
        for add in (False, True):
            k = compile_sm90(_rmsnorm_rows, {"eps": "fp32", **{p: "*" + dt for p in POINTERS}},
                             {"HAS_ADD": add, "BLOCK": ROW_BLOCK, "VEC": VEC, "LIBDEVICE": True},
                             (*POINTERS, "d", "stride_x", "stride_a", "stride_o"), **OPTS)
            got = (reduce_layouts(k.asm["ttgir"]), reduction(k.asm["ptx"]))
            wrong = [what for what, a, b in (("layout", got[0], want[0]), ("reduction", got[1], want[1])) if a != b]
            if "div.full.f32" not in k.asm["ptx"] or "div.full.f32" not in ref.asm["ptx"]:
                wrong.append("the mean's division")
            failed += bool(wrong)
            print(f"{'FAILED' if wrong else 'ok':<6} {dt} add={add}: layout {got[0][0]}, {len(got[1])} reduction "
                  f"instructions{'  ' + ', '.join(wrong) if wrong else ''}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
