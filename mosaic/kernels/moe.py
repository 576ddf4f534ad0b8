"""A MoE layer's routed experts over rows sorted by expert: the per-expert loop (the reference,
CPU oracle) and the grouped GEMM (torch._grouped_mm), both writing the same [n*k, d] slots.

Every routed (row, slot) pair -- row t of h [n, d] sent to expert top_i[t, j] -- is one of
R = n*k rows. A stable sort of the R expert ids groups them by expert (ties stay in (row, slot)
order, as the published loops visit them); `offs` [E] int32 holds each expert's end row in that
order (the grouped GEMM's group offsets). Then per expert e, over its rows r:

    slots[order[r]] = down_e(silu(gate_e(h[order[r] // k])) * up_e(h[order[r] // k]))

Shapes depend only on (n, k, d, F, E), never on the routing, and the grouped path reads nothing
back to the host (no .item(), .tolist(), bincount, nonzero, boolean indexing or
repeat_interleave): `sort_by_expert` counts with a stable sort and searchsorted, so a step is
capturable as a CUDA graph. On meta tensors (no data) it runs; the loop raises, which
tests/kernels/test_moe.py uses as a host-sync detector.

Bits: torch._grouped_mm's CPU kernel multiplies each group with one mm over the group's rows
(aten _grouped_mm_fallback), the loop's very products, and the CPU's silu runs per group (see
_per_group): identical on the CPU (tested) while a call's routed rows fit one GROUP_TILE; an
expert cut by a tile boundary (steps of more than 8192 routed rows) runs as two products,
which MKL may round differently from one. On CUDA the bf16 fast path is CUTLASS's grouped GEMM
(sm90 / sm100); the design probe on the H200 measured it equal to the per-expert cuBLAS loop
(bench/results/gpu/session7/design_probe_29bb6f0.json, "moe": rel. err. 0.0 at 32-1024 rows);
tests/gpu/test_moe_gpu.py checks it bit for bit. Other dtypes on CUDA would take aten's
fallback, which copies the offsets to the host: the chooser (kernels.moe_kernel) never picks it
there."""

from __future__ import annotations

import torch

from . import interpret, want_triton
from . import reference as R

INDEX_BYTES = 8 * 4 + 4   # per routed row: sorted keys, order, the source row, a key copy (int64); offs
# routed rows per grouped GEMM call: its outputs ([rows, F] twice, then [rows, d]) live outside
# the plan, and the budget charges the largest outside allocation on top of the whole plan, so
# an untiled call at LLaDA-MoE's 24 GiB L_max (497k routed rows a chunk: 3.1 GB) cut L_max by
# 30% (796,672 -> 559,104). 8192 rows: 50 MB at F 1024, d 2048; a tile boundary inside an
# expert re-reads its weights once (at most R / 8192 times a layer).
GROUP_TILE = 8192


def sort_by_expert(top_i: torch.Tensor, lo: int = 0, held: int | None = None,
                   num_experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [R] int64, offs [held] int32) for top_i [n, k] int64 expert ids, R = n*k.

    order lists the routed rows (index t*k + j) grouped by expert, ascending, ties in (row, slot)
    order; offs[e] is the end of expert lo + e's rows in it. Under tensor parallelism a rank holds
    experts [lo, lo + held): the rows of the other experts sort after offs[-1] (rows a grouped GEMM
    leaves unwritten). No host synchronisation: a stable sort and a searchsorted of [held] ids."""
    flat = top_i.reshape(-1)
    E = num_experts if num_experts is not None else (held or 0)
    held = E if held is None else held
    key = flat
    if lo != 0 or held != E:   # another rank's experts: key `held`, after every held one
        key = flat - lo
        key = torch.where((key >= 0) & (key < held), key, torch.full_like(key, held))
    keys, order = torch.sort(key, stable=True)
    ids = torch.arange(held, device=flat.device, dtype=keys.dtype)
    offs = torch.searchsorted(keys, ids, right=True).to(torch.int32)
    return order, offs


def index_bytes(rows: int, experts: int) -> int:
    """Out-of-plan bytes of sort_by_expert for `rows` routed rows and `experts` groups: the sort's
    keys and order and its double buffers, the source rows, the ids and int64 / int32 offsets."""
    return rows * INDEX_BYTES + experts * (8 + 8 + 4)


def experts_grouped(slots: torch.Tensor, h: torch.Tensor, order: torch.Tensor, offs: torch.Tensor, k: int,
                    w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, xs: torch.Tensor,
                    silu_mul, tile: int = GROUP_TILE) -> None:
    """slots [R, d] (routed rows in (row, slot) order) of h [n, d] through the experts' SwiGLU,
    every expert in one grouped GEMM per projection and tile of `tile` sorted rows. xs [R, d]:
    planned scratch for the rows in expert order (then their outputs); w_gate, w_up [E, F, d],
    w_down [E, d, F] (one rank's experts under tensor parallelism); silu_mul(g, u): g = silu(g)
    * u in place. torch._grouped_mm allocates its outputs ([tile, F] twice, then [tile, d]:
    grouped_bytes). Rows of experts not held (after offs[-1]) come out unspecified: the combine
    masks them. A tile's group offsets are offs shifted and clamped on the device (no sync)."""
    R.gather_rows(xs, h, order // k)
    rows = order.shape[0]
    for r0 in range(0, rows, tile):
        r1 = min(rows, r0 + tile)
        o = offs if rows <= tile else (offs - r0).clamp_(0, r1 - r0)
        x = xs[r0:r1]
        g = torch._grouped_mm(x, w_gate.transpose(1, 2), offs=o)           # [r, F]
        u = torch._grouped_mm(x, w_up.transpose(1, 2), offs=o)             # [r, F]
        _per_group(silu_mul, g, u, o)
        del u
        x.copy_(torch._grouped_mm(g, w_down.transpose(1, 2), offs=o))      # [r, d]: this tile's outputs
    slots.index_copy_(0, order, xs)


def _per_group(silu_mul, g, u, offs) -> None:
    """silu_mul over the rows of every group at once, except on the CPU: there PyTorch's vector
    loop computes the elements of a call's scalar tail with libm, whose silu can differ from the
    SIMD lanes' in the last bit (measured: F = 12, 4 of 480 elements), so the tail depends on the
    call's size. One call per group there gives the loop's bits for any F (a CPU step is never
    captured, so reading the offsets there costs nothing)."""
    if g.device.type != "cpu":
        silu_mul(g, u)
        return
    r = 0
    for end in offs.tolist():
        if end > r:
            silu_mul(g[r:end], u[r:end])
        r = end


def grouped_bytes(rows: int, d: int, F: int, itemsize: int, tile: int = GROUP_TILE) -> int:
    """The grouped GEMMs' own outputs at their peak (gate and up [r, F], then gate and down [r,
    d], r = min(rows, tile)) and a tile's shifted offsets."""
    return min(rows, tile) * max(2 * F, F + d) * itemsize + 64


def experts_loop(slots: torch.Tensor, h: torch.Tensor, order: torch.Tensor, offs: torch.Tensor, k: int,
                 w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, xs: torch.Tensor,
                 g: torch.Tensor, u: torch.Tensor, matmul, silu_mul) -> None:
    """The reference: as experts_grouped, one expert at a time with its own products (the
    published modeling code's loop over experts). Reads the group offsets on the host (one sync
    per call): not capturable. xs [>= c, d], g, u [>= c, F]: planned scratch for the largest
    expert's c rows (at most n); matmul(out, x, w): out = x @ w^T."""
    ends = offs.tolist()                                                   # the host sync
    r = 0
    for j, end in enumerate(ends):
        c = end - r
        if c == 0:
            continue
        idx = order[r:end]                                                 # (row, slot) indices of expert j
        R.gather_rows(xs[:c], h, idx // k)
        matmul(g[:c], xs[:c], w_gate[j])
        matmul(u[:c], xs[:c], w_up[j])
        silu_mul(g[:c], u[:c])
        matmul(xs[:c], g[:c], w_down[j])
        slots.index_copy_(0, idx, xs[:c])
        r = end


# -- the Triton experts kernel (moe_triton.py): its tiles and block table, chosen here without
# importing Triton (the CPU install has none)
def tiles(rows: int, experts: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, warps, stages) for `rows` routed rows over `experts` experts (a static guess
    from the mean rows per expert: small blocks when most experts get a row or two)."""
    if interpret():
        return 16, 16, 16, 1, 1
    mean = rows / max(1, experts)
    bk = 32 if dtype == torch.float32 else 64
    if mean <= 16:
        return 16, 64, 2 * bk, 4, 4
    if mean <= 64:
        return 32, 64, bk, 4, 4
    return 64, 128, bk, 8, 3


def num_blocks(rows: int, experts: int, bm: int) -> int:
    """Blocks of at most bm rows, none straddling two experts: at most one partial block per
    expert beyond rows / bm, and never more than one per row."""
    return max(1, min(rows, -(-rows // bm) + experts))


def triton_bytes(experts: int, blocks: int) -> int:
    """Out-of-plan bytes of the block table's construction ([E] and [blocks] int64 temporaries)."""
    return experts * 8 * 4 + blocks * 8 * 6


def triton_table_shape(rows: int, experts: int, dtype: torch.dtype) -> tuple[int, int]:
    """The block table's shape [3, blocks] (int32) for `rows` routed rows over `experts`."""
    return 3, num_blocks(rows, experts, tiles(rows, experts, dtype)[0])


def experts_triton(slots, h, order, offs, k, w_gate, w_up, w_down, act, table) -> None:
    """moe_triton.experts (imported here: Triton is optional)."""
    from . import moe_triton as MT
    config = tiles(slots.shape[0], w_gate.shape[0], h.dtype)
    MT.experts(slots, h, order, offs, k, w_gate, w_up, w_down, act, table, config)


def combine_f32(acc: torch.Tensor, slots: torch.Tensor, w: torch.Tensor, acc32: torch.Tensor) -> None:
    """acc [n, d] (model dtype) = the fp32 sum over slot j = 0..k-1, in that order from zero, of
    float32(slots[t, j]) * w[t, j] (LLaDA2's published .sum(dim=1) of the weighted expert outputs);
    slots [n*k, d] in (row, slot) order, w [n, k] fp32, acc32 [n, d] fp32 scratch."""
    n, k = w.shape
    acc32.zero_()
    per_slot = slots.view(n, k, -1)
    for a, b in R.row_tiles(n):      # a tile's fp32 slot and product at a time, not [n, d]
        for j in range(k):
            acc32[a:b].add_(per_slot[a:b, j].float() * w[a:b, j:j + 1])
    acc.copy_(acc32)


def combine_model_dtype(acc: torch.Tensor, slots: torch.Tensor, w: torch.Tensor, held=None) -> None:
    """acc [n, d] = the sum over slot j = 0..k-1 of slots[t, j] * w[t, j], every product and sum
    rounded to the model dtype (LLaDA-MoE's published index_add over experts in id order: its
    slots come sorted by expert id); w [n, k] in the model dtype; held [n, k] bool or None: the
    slots of experts this rank holds (tensor parallelism; the others add nothing)."""
    n, k = w.shape
    acc.zero_()
    per_slot = slots.view(n, k, -1)
    y = torch.empty((min(n, R.ROW_TILE), acc.shape[1]), dtype=acc.dtype, device=acc.device)
    for a, b in R.row_tiles(n):      # one tile's weighted slot at a time, not [n, d]
        t = y[:b - a]
        for j in range(k):
            torch.mul(per_slot[a:b, j], w[a:b, j:j + 1], out=t)
            if held is not None:    # another rank's expert: its slot is unspecified
                t.masked_fill_(~held[a:b, j:j + 1], 0)
            acc[a:b].add_(t)


def combine(acc: torch.Tensor, slots: torch.Tensor, w: torch.Tensor, fp32: bool, acc32: torch.Tensor | None = None,
            held: torch.Tensor | None = None, setting: str = "auto") -> None:
    """combine_f32 (fp32, with its acc32 scratch) or combine_model_dtype, by the PyTorch ops or
    by one Triton kernel with their bits (moe_combine_triton.py; kernels.want_triton(setting):
    the elementwise kernels' setting, since it is one of them)."""
    if want_triton(acc.device.type, setting):
        from . import moe_combine_triton as T
        T.combine(acc, slots, w, fp32, held)
    elif fp32:
        combine_f32(acc, slots, w, acc32)
    else:
        combine_model_dtype(acc, slots, w, held)


def combine_bytes(n: int, d: int, itemsize: int, fp32: bool) -> int:
    """Out-of-plan bytes of the reference combines (a row tile's slot in fp32 and its product,
    or its weighted slot, and the mask's negation); the Triton kernel allocates nothing."""
    rows = min(n, R.ROW_TILE)
    return rows * d * 4 * 2 if fp32 else rows * d * itemsize + rows * 8
