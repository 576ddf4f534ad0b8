"""Batch-invariant ops: each row's result is the same bits whatever rows surround it and however
many there are (EngineConfig.batch_invariant; docs/MODELS.md "Batch-invariant mode").

Why the default ops are not (He et al., "Defeating Nondeterminism in LLM Inference", Thinking
Machines 2025, and its batch_invariant_ops library): a library GEMM picks its kernel, tile and
split-K by the matrix shape, so a row's dot products are summed in an order that depends on how
many rows the call has. Measured here on the CPU (MKL 2024.2, AVX2, float32): with 2 threads a
row of a product of m = 1-3, 5-7 or 9-11 rows differs in the last bit from the same row in a
larger product; with 16 threads m = 17-19 and 25-27 differ too. Within one call shape, a row's
result depends neither on its position nor on the other rows (measured for 16-64-row tiles, 1-16
threads). What is taken from the library above: matrix products without split-K whose K loop is
one per dtype (each output's K loop runs in one program, in order, with one BK and one MMA
family, whatever the output tile: invariant_tiles.py), reductions with one program
per row, and a fixed split count where a kernel splits a reduction (the fused logits' vocabulary
splits), combined in a fixed order.

  linear     out [n, o] = x [n, i] @ w [o, i]^T (+ b): Triton on CUDA, its tile from the shape
             (invariant_triton.py); on the CPU torch.mm over fixed tiles of TILE_ROWS rows, the
             last one padded, so every call has one shape
  attention  CPU: SDPA over fixed tiles of TILE_ROWS query rows (the same reason); CUDA: Mosaic's
             Triton attention without split-K (ctx.attention)
  row_mean   per-row mean of x [n, d] (RMSNorm's statistic): one program per row on CUDA;
             PyTorch's CPU mean over the last dim is already per row (measured, 1-16 threads)
  pointwise  CPU transcendental elementwise ops (silu, sigmoid, sin, cos): PyTorch's vectorised
             loop leaves a scalar tail whose libm result can differ from the SIMD lane's in the
             last bit (measured, AVX-512: silu over [c, 16] differs for 28 of 66 rows between
             c rows and one row; [c, 32] and [c, 64] never), so which elements fall in the tail
             depends on the row count. pointwise_rows runs the op over row chunks copied into
             a scratch whose rows are padded to a multiple of 64 elements and which stays under
             PyTorch's parallel grain: one thread, every element in the same SIMD lane, no tail"""

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


ALIGN = 64                # elements: a multiple of every SIMD loop's step (AVX-512 unrolled x2: 32)
GRAIN = 32768             # elements: at::internal::GRAIN_SIZE, below which a CPU loop is one thread


def pointwise_bytes(num_tensors: int, itemsize: int = 4) -> int:
    """Bytes pointwise_rows allocates outside the plan at most: one scratch chunk per tensor."""
    return num_tensors * GRAIN * itemsize


def pointwise_rows(fn, *ts: torch.Tensor) -> None:
    """fn(*chunks) in place over 2-D tensors ts, each [n, F] (same n), so that a row's result
    does not depend on n (module docstring, `pointwise`). fn gets scratch views [r, F_pad]
    (F_pad: F rounded up to ALIGN, zero padded) and must write its results into them; the first
    F columns are copied back to every tensor. On CUDA fn runs on ts directly (a kernel's element
    result does not depend on where the element sits)."""
    if ts[0].device.type == "cuda" or ts[0].numel() == 0:
        fn(*ts)
        return
    n = ts[0].shape[0]
    widths = [t.shape[1] for t in ts]
    pads = [-(-w // ALIGN) * ALIGN for w in widths]
    rows = max(1, GRAIN // max(pads))
    for a in range(0, n, rows):
        e = min(n, a + rows)
        chunks = []
        for t, w, wp in zip(ts, widths, pads):
            c = t.new_zeros(e - a, wp)
            c[:, :w] = t[a:e]
            chunks.append(c)
        fn(*chunks)
        for t, w, c in zip(ts, widths, chunks):
            t[a:e] = c[:, :w]


def silu_mul_(g: torch.Tensor, u: torch.Tensor) -> None:
    """g = silu(g) * u in place, [n, F], row-invariant on the CPU (pointwise_rows)."""
    pointwise_rows(R.silu_mul_, g, u)


def rope_cos_sin(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """reference.rope_cos_sin, row-invariant on the CPU: the products are exact IEEE multiplies,
    the sin and cos run through pointwise_rows."""
    torch.mul(positions.to(torch.float32)[:, None], inv_freq[None, :], out=cos)

    def sin_cos(c, s):
        torch.sin(c, out=s)
        c.cos_()
    pointwise_rows(sin_cos, cos, sin)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid of x [n, E], row-invariant on the CPU (pointwise_rows); a new tensor."""
    out = x.clone()
    pointwise_rows(lambda c: c.sigmoid_(), out)
    return out
