"""Choosing a block-sparse layout from cheap estimates, into caller-given buffers.

The query side of the minmax and mean estimates is the mean of each query block's rows (over the
G query heads of a key/value head too); rows bounds every query row. The key side
(SparseConfig.estimate):

  minmax  (default) an upper bound of the block's largest q·k: the channel-wise max and min of
          each key block's keys, scored as sum_d max(q_d * kmax_d, q_d * kmin_d)
          = relu(q) · kmax + min(q, 0) · kmin (Quest, Tang et al. 2024). One key that matches
          the query (a copy source, a needle) lifts its block's bound as it lifts the true
          attention, while a mean over the block's keys dilutes it b times;
  rows    the key bounds as in minmax, but against every query row (not the pooled query),
          each row's bounds relative to its best block, the largest over the query block
          (row_bound_scores_into): the answer rows of a block keep their far blocks;
  mean    the mean of each key block's keys, dotted with the pooled query (the MInference /
          FlexPrefill pooled estimate). Measured on the long-context copy task (4k tokens, block
          64, keep 0.1): it kept the source span's block for 0-33% of the heads that put 50-98%
          of their answer rows' attention there (minmax: 100%), and copy accuracy fell from
          1.00 dense to ~0.0.

Both cost 2 or 4 * (nq / b) * (Nk / b) * Hkv * hd FLOPs, about 1 / (b^2 * G) of the attention
they prune (< 0.01% at b = 128), so layouts are re-estimated at every step instead of cached.
Selection is
a top-k per (head, query block) over the scores with the forced blocks (the local window around
the query block's own key block and the first global blocks) raised to +inf, so every row keeps
exactly the same number of blocks and the layout is a regular CSR (indptr an arithmetic
sequence). Patterns (config.SparseRange): window, global_local (distance-only scores) and topk.

Sources: the pooled block estimate follows the block-sparse prefill literature (e.g. MInference,
Jiang et al. 2024; FlexPrefill, Lai et al. 2025); dense early steps and head-specific patterns
that stay stable over denoising steps follow SparseD (Wang et al. 2025) for diffusion LLMs.
"""

from __future__ import annotations

import torch

from .attention_layout import BlockLayout

NEG = -1e30


def block_means_into(out: torch.Tensor, x: torch.Tensor, block: int, group: int = 1) -> None:
    """out [Hkv, nb, hd] fp32 = mean over each block of rows (and over the `group` heads sharing a
    key/value head) of x [n, Hkv * group, hd]; the last block averages its real rows only."""
    n, h, hd = x.shape
    hkv, nb = h // group, out.shape[1]
    full = n // block
    if full:  # fp32 accumulation without an fp32 copy of x; the [full, Hkv, hd] result is small
        xs = x[: full * block].reshape(full, block, hkv, group, hd)
        out[:, :full].copy_(xs.mean(dim=(1, 3), dtype=torch.float32).transpose(0, 1))
    if full < nb:
        tail = x[full * block:].reshape(n - full * block, hkv, group, hd)
        out[:, full].copy_(tail.mean(dim=(0, 2), dtype=torch.float32))


def block_minmax_into(out: torch.Tensor, x: torch.Tensor, block: int) -> None:
    """out [2, Hkv, nb, hd] fp32: out[0] the channel-wise max, out[1] the min over each block of
    rows of x [n, Hkv, hd] (the last block over its real rows): the key bounds of the minmax
    estimate."""
    n = x.shape[0]
    nb = out.shape[2]
    full = n // block
    if full:
        xs = x[: full * block].unflatten(0, (full, block))                 # [full, b, Hkv, hd]
        out[0, :, :full].copy_(xs.amax(dim=1).transpose(0, 1))
        out[1, :, :full].copy_(xs.amin(dim=1).transpose(0, 1))
    if full < nb:
        tail = x[full * block:]
        out[0, :, full].copy_(tail.amax(dim=0))
        out[1, :, full].copy_(tail.amin(dim=0))


def bound_scores_into(scores: torch.Tensor, qpool: torch.Tensor, kbound: torch.Tensor) -> None:
    """scores [Hkv, nqb, nkb] = sum_d max(q_d * kmax_d, q_d * kmin_d) for the pooled queries
    qpool [Hkv, nqb, hd] (overwritten: its positive and negative parts are taken in place) and
    kbound [2, Hkv, nkb, hd] from block_minmax_into: an upper bound of max_k q·k over the block's
    keys for the pooled query (Quest's criticality)."""
    neg = qpool.clamp(max=0)                                             # [Hkv, nqb, hd], small
    qpool.clamp_(min=0)
    torch.bmm(qpool, kbound[0].transpose(1, 2), out=scores)
    scores.baddbmm_(neg, kbound[1].transpose(1, 2))


ROWS_TILE_BYTES = 32 * 2**20   # fp32 bound scores per tile of query rows in row_bound_scores_into


def rows_tile(block: int, group: int, nkb: int) -> int:
    """Query rows per tile of row_bound_scores_into: whole blocks, about ROWS_TILE_BYTES of
    [G, rows, nkb] fp32 scores."""
    return block * max(1, ROWS_TILE_BYTES // (4 * group * nkb * block))


def rows_tile_bytes(block: int, group: int, nkb: int, hd: int) -> int:
    """Bytes row_bound_scores_into allocates at once: two [G, rows, nkb] fp32 score tiles and
    two [G, rows, hd] fp32 query parts."""
    t = rows_tile(block, group, nkb)
    return 2 * group * t * nkb * 4 + 2 * group * t * hd * 4


def row_bound_scores_into(scores: torch.Tensor, q: torch.Tensor, kbound: torch.Tensor, block: int) -> None:
    """scores [Hkv, nqb, nkb] = for each query block and key block, the largest over the block's
    query rows (and the G query heads of the key/value head) of that row's Quest bound of the key
    block minus the row's best bound over all key blocks (<= 0; 0 where the block is some row's
    most promising one). q [nq, Hq, hd]; kbound [2, Hkv, nkb, hd] from block_minmax_into.

    Pooling the queries first (minmax, mean) lets the 56 prompt rows of a 64-row block outvote the
    8 answer rows that need one far block; bounding per row keeps every row's best blocks in
    reach. Costs 4 * nq * Hq * nkb * hd FLOPs: 1/block of the dense attention (0.8% at 128)."""
    nq, hq, hd = q.shape
    hkv, nqb, nkb = scores.shape
    g = hq // hkv
    tile = rows_tile(block, g, nkb)
    for h in range(hkv):
        kb = kbound[:, h:h + 1].expand(2, g, nkb, hd)                      # the head's bounds per G
        for a in range(0, nq, tile):
            e = min(nq, a + tile)
            # a copy in every dtype: bound_scores_into takes its positive part in place, and a
            # float32 q's .float() is q itself (the model's queries were clamped: keep 1.0 != dense)
            qt = q[a:e, h * g:(h + 1) * g].transpose(0, 1).to(torch.float32, copy=True)   # [G, t, hd]
            bnd = qt.new_empty(g, e - a, nkb)
            bound_scores_into(bnd, qt, kb)                                 # each row its own query
            bnd.sub_(bnd.amax(-1, keepdim=True))
            nb = -(-(e - a) // block)
            if (e - a) % block:                                            # the last, partial block
                bnd = torch.cat([bnd, bnd.new_full((g, nb * block - (e - a), nkb), NEG)], 1)
            scores[h, a // block:a // block + nb] = bnd.view(g, nb, block, nkb).amax(dim=(0, 2))


def select_into(scores: torch.Tensor, q_block0: int, rng, block: int, k_total: int,
                top_v: torch.Tensor, top_i: torch.Tensor, indices: torch.Tensor,
                indptr: torch.Tensor, heads_per_layout: str = "kv") -> BlockLayout:
    """The layout of one query chunk from scores [H, nqb, nkb] fp32 (pooled q·k, overwritten).

    q_block0: the key block holding the chunk's first query row (its own position minus the
    left padding, divided by the block size, rounded down: negative when the chunk starts in
    the padding), so that query block i's own key block is q_block0 + i, clipped to the key
    blocks; rng: the layer's config.SparseRange; k_total: blocks kept per query block
    (<= nkb); top_v, top_i [H, nqb, k_total] fp32 / int64 scratch; indices [H * nqb * k_total]
    int32 and indptr [H, nqb + 1] int32 receive the layout."""
    h, nqb, nkb = scores.shape
    dev = scores.device
    j = torch.arange(nkb, device=dev)
    center = (q_block0 + torch.arange(nqb, device=dev)).clamp_(0, nkb - 1)
    dist = (j[None, :] - center[:, None]).abs_()                          # [nqb, nkb]
    if rng.pattern in ("window", "global_local"):
        scores.copy_((-dist.float())[None].expand(h, nqb, nkb))         # nearest blocks first
    if rng.pattern == "global_local" or rng.global_blocks:
        scores[:, :, : rng.global_blocks] = -NEG
    scores.masked_fill_((dist <= rng.window)[None], -NEG)
    torch.topk(scores, k_total, dim=-1, out=(top_v, top_i))
    top_i.copy_(top_i.sort(dim=-1).values)
    indices.view(h, nqb, k_total).copy_(top_i)
    torch.arange(nqb + 1, device=dev, dtype=torch.int32, out=indptr[0])
    indptr.copy_(indptr[0][None] * k_total + (torch.arange(h, device=dev, dtype=torch.int32) * nqb * k_total)[:, None])
    return BlockLayout(block, block, indptr, indices, heads_per_layout, nkb)
