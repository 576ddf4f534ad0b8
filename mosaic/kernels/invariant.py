"""Batch-invariant ops: each row's result is the same bits whatever rows surround it and however
many there are (EngineConfig.batch_invariant; docs/MODELS.md "Batch-invariant mode").

Why the default ops are not (He et al., "Defeating Nondeterminism in LLM Inference", Thinking
Machines 2025, and its batch_invariant_ops library): a library GEMM picks its kernel, tile and
split-K by the matrix shape, so a row's dot products are summed in an order that depends on how
many rows the call has. Measured here on the CPU (MKL 2024.2, AVX2, float32): with 2 threads a
row of a product of m = 1-3, 5-7 or 9-11 rows differs in the last bit from the same row in a
larger product; with 16 threads m = 17-19 and 25-27 differ too. Within one call shape, a row's
result depends neither on its position nor on the other rows (measured for 16-64-row tiles, 1-16
threads). What is taken from the library above: matrix products with one fixed tile per dtype
and no split-K (each output's K loop runs in one program, in order), reductions with one program
per row, and a fixed split count where a kernel splits a reduction (the fused logits' vocabulary
splits), combined in a fixed order.

  linear     out [n, o] = x [n, i] @ w [o, i]^T (+ b): Triton with a fixed tile on CUDA
             (invariant_triton.py); on the CPU torch.mm over fixed tiles of TILE_ROWS rows, the
             last one padded, so every call has one shape
  attention  CPU: SDPA over fixed tiles of TILE_ROWS query rows (the same reason); CUDA: Mosaic's
             Triton attention without split-K (ctx.attention)
  row_mean   per-row mean of x [n, d] (RMSNorm's statistic): one program per row on CUDA;
             PyTorch's CPU mean over the last dim is already per row (measured, 1-16 threads)"""

from __future__ import annotations

import torch

from . import reference as R
from . import want_triton

TILE_ROWS = 64   # CPU tile: 1.2-2.5x the time of one MKL call at LLaDA-8B's widths (bench speculative)


def tiles(n: int, tile: int = TILE_ROWS):
    """[(a, b)] row ranges of `tile` rows covering n (the last one shorter)."""
    return [(a, min(n, a + tile)) for a in range(0, n, tile)]


def pad_bytes(x: torch.Tensor, o: int, tile: int = TILE_ROWS) -> int:
    """Bytes the CPU path allocates for a padded last tile (input and output rows): 0 when n is a
    multiple of the tile."""
    return 0 if x.shape[0] % tile == 0 else tile * (x.shape[1] + o) * x.element_size()


def linear(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
           setting: str = "auto") -> None:
    """out [n, o] = x [n, i] @ w [o, i]^T (+ b [o]), row-invariant (module docstring). setting:
    'auto' | 'triton' | 'torch' (kernels.want_triton: Triton on CUDA, or under the interpreter)."""
    if x.shape[0] == 0:
        return
    if want_triton(x.device.type, setting):
        from . import invariant_triton as T
        T.matmul(out, x, w, b)
        return
    linear_tiles(out, x, w, b)


def linear_tiles(out, x, w, b=None, tile: int = TILE_ROWS) -> None:
    """The PyTorch path of `linear`: one torch.mm (addmm with a bias) per tile of exactly `tile`
    rows; the last tile is padded with zero rows through a scratch."""
    n = x.shape[0]
    for a, e in tiles(n, tile):
        if e - a == tile:
            R.linear(out[a:e], x[a:e], w, b)
            continue
        xp = x.new_zeros(tile, x.shape[1])
        xp[: e - a] = x[a:e]
        op = out.new_empty(tile, out.shape[1])
        R.linear(op, xp, w, b)
        out[a:e] = op[: e - a]


def attention_tiles(out, q, k, v, tile: int = TILE_ROWS) -> None:
    """reference.attention over fixed tiles of `tile` query rows (the last padded): out
    [nq, Hq*hd], q [nq, Hq, hd], k, v [Nk, Hkv, hd]."""
    nq = q.shape[0]
    for a, e in tiles(nq, tile):
        if e - a == tile:
            R.attention(out[a:e], q[a:e], k, v)
            continue
        qp = q.new_zeros(tile, *q.shape[1:])
        qp[: e - a] = q[a:e]
        op = out.new_empty(tile, out.shape[1])
        R.attention(op, qp, k, v)
        out[a:e] = op[: e - a]


def attention_tile_bytes(q: torch.Tensor, tile: int = TILE_ROWS) -> int:
    """Bytes attention_tiles allocates outside the plan at once: SDPA's output and regrouped q of
    one tile, the padded tile's q and output copies."""
    nq, hq, hd = q.shape
    t = min(nq, tile)
    return 4 * tile * hq * hd * q.element_size() + hq * (t + 32) * 4


def row_mean(out: torch.Tensor, x: torch.Tensor) -> None:
    """out [n, 1] fp32 = mean of each row of x [n, d] fp32, summed in one fixed order per row."""
    if want_triton(x.device.type, "auto"):
        from . import invariant_triton as T
        T.row_mean(out, x)
    else:
        torch.mean(x, -1, keepdim=True, out=out)
