"""The batch-invariant matmul's tile (invariant_triton.matmul) as a pure function of the shapes.

What keeps a row's bits independent of M (the rows in the call): every output element's K loop
must be the same, i.e. the same BK, the same K order, no split-K and the same dot precision. The
output tile (BM x BN) only says which program computes an element, not in what order its
products are summed, provided the MMA instruction is of one family: Triton lowers a 16-bit
tl.dot on Hopper to wgmma (m64nNk16, one warpgroup per 64 rows) when BM is a multiple of 64 and
the warps a multiple of 4, and to mma.sync (m16n8k16) otherwise, whose accumulation inside a
k-step need not match. So BK is fixed per dtype (64 for 16-bit, 32 for fp32, whose IEEE dot is
FMAs in K order for any tile), BM is 64 or 128, BN 32-128 with 4 or 8 warps: every tile in TILES
lowers to wgmma k16 steps in K order (tools/gemm_compile_check.py shows it for sm_90a;
tests/gpu/test_invariant_gemm_gpu.py checks the bits of every tile against the others).

Why the tile varies: one 128 x 128 tile for every shape gave a batch-1 block step (M = 32 rows)
1 x 32 = 32 programs for N = 4096 on the H200's 132 SMs, and the weight-bound GEMMs read the
weights at a fraction of the bandwidth (batch-invariant mode at 0.52x the default's speed at
batch 1, 0.89x at batch 16). The rule:
  M > 128 and 128 x 128 gives >= SMs / 2 programs: 128 x 128 (compute-bound: the big tile; M =
           512 x N = 4096 is 128 programs, 97% of the SMs)
  else     BM = 64 for M <= 64, else 128; BN the largest of 128, 64, 32 whose programs keep
           >= FILL of the SMs busy over the waves they take (programs / (SMs * waves)), else the
           best-filling one. E.g. M = 32 on 132 SMs: N = 4096 -> 64 x 32 (128 programs),
           N = 24576 -> 64 x 128 (192 programs, 73%), N = 126464 -> 64 x 128 (988, 94%)
M <= 128 rows is the weight-bound side: a GEMM's FLOPs per weight byte are M, under the H200's
~200 (989 TFLOP/s dense bf16 / 4.8 TB/s), so the tile's MMA efficiency matters less than the
number of SMs streaming weights. Each tile's stages keep about 96 KiB of operands in flight
(today's 128 x 128 x 64 with 3 stages), the thinner tiles deeper."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tile:
    """bm x bn outputs per program, bk columns of K per step; warps, stages: Triton's launch."""
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int


BIG = (128, 128)
# (BM, BN) -> (warps, stages): 8 warps for 128 rows (two warpgroups of 64), 4 for 64; stages such
# that (BM + BN) * 64 * 2 bytes * stages ~ 96 KiB (fp32's BK = 32 has the same bytes per stage).
# fp32 runs 8 warps on every tile: its FMA dot holds BM * BN / threads accumulators per thread,
# and 64 x 64 / 64 x 128 with 4 warps spilled (ptxas, sm_90a: tools/gemm_compile_check.py)
TILES = {(128, 128): (8, 3), (128, 64): (8, 4), (128, 32): (8, 4),
         (64, 128): (4, 4), (64, 64): (4, 6), (64, 32): (4, 8)}
SMALL_M = 128          # rows: weight-bound below (module docstring)
FILL = 0.7             # fraction of the SMs a small-M grid must keep busy over its waves: at M = 32,
# N = 24576 64 x 128 (73%) ran at 0.98x torch.mm vs 64 x 64's 0.90x (the H200, gemm sweep at c876f21)
INTERPRET = Tile(16, 16, 16, 1, 1)   # TRITON_INTERPRET=1: one small tile (numpy per program)


def bk_of(dtype: torch.dtype) -> int:
    """K columns per step: 32 for fp32 (IEEE FMA dot), 64 for 16-bit (four wgmma k16 steps)."""
    return 32 if dtype == torch.float32 else 64


def programs(m: int, n: int, bm: int, bn: int) -> int:
    return -(-m // bm) * -(-n // bn)


def fill(p: int, sms: int) -> float:
    """Fraction of SM time busy when p equal programs run one per SM in waves: p / (sms * waves)."""
    return p / (sms * -(-p // sms)) if p else 0.0


def tile(m: int, n: int, dtype: torch.dtype, sms: int) -> Tile:
    """The tile of an [m, K] x [K, n] product on a GPU of `sms` SMs (module docstring). K does
    not enter: the K loop is the same for every tile. Raises ValueError for m, n < 1."""
    if m < 1 or n < 1 or sms < 1:
        raise ValueError(f"tile: m {m}, n {n}, sms {sms} must be >= 1")
    if m > SMALL_M and 2 * programs(m, n, *BIG) >= sms:
        return make(*BIG, dtype)
    bm = 64 if m <= 64 else 128
    bns = (128, 64, 32)
    bn = next((b for b in bns if fill(programs(m, n, bm, b), sms) >= FILL), None)
    if bn is None:
        bn = max(bns, key=lambda b: (fill(programs(m, n, bm, b), sms), b))
    return make(bm, bn, dtype)


def make(bm: int, bn: int, dtype: torch.dtype) -> Tile:
    """TILES' launch for (bm, bn) with the dtype's BK. Raises KeyError for a pair not in TILES."""
    warps, stages = TILES[(bm, bn)]
    return Tile(bm, bn, bk_of(dtype), 8 if dtype == torch.float32 else warps, stages)


def all_tiles(dtype: torch.dtype) -> list[Tile]:
    """Every tile `tile` can return for dtype (the GPU test checks them against each other)."""
    return [make(bm, bn, dtype) for bm, bn in TILES]
