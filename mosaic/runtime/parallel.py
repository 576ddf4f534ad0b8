"""Sequence (context) parallelism over torch.distributed, execution side: which masked slots a
rank owns and how the per-slot results meet again. Each rank holds a contiguous slice of every
sequence's positions (Shard, chunk bounds and broadcast are graph primitives: graph/shard.py).

Per layer a rank builds K and V for its own rows only; every query chunk then attends to each
rank's K/V shard in turn — the owner broadcasts it, piece_rows rows at a time, into a small
receive buffer — merging the partial results in log-sum-exp form. A rank's floor is therefore
(x + K + V) / world plus the receive buffer,
so the longest context grows with the number of ranks (an all-gather of K/V would keep the whole
K + V on every rank: 16 KiB per token for LLaDA-8B, at most 1.5x more context however many
GPUs). At a million tokens attention is ~20 s of math per layer per rank against well under a
second of shard traffic over NVLink. FFN/MoE and the masked logits stay local; the Dream shift's
row j-1 crosses a shard boundary through a one-row halo; the sampler runs identically on every
rank (same canvas, same generator) after the per-slot results are exchanged.
"""

from __future__ import annotations

import torch

from ..graph.shard import Shard, broadcast


def localize(positions: torch.Tensor, L: int, B: int, shard: Shard, shift: bool):
    """Slots whose position this rank owns, and the local row each reads: its own position, or
    with the Dream shift position - 1 — the halo row (after the B*rows body) at a shard start."""
    j = positions % L
    b = positions // L
    mine = (j >= shard.lo) & (j < shard.hi)
    idx = mine.nonzero().squeeze(1)
    jj, bb = j[idx], b[idx]
    src = torch.where(jj > 0, jj - 1, jj) if shift else jj
    rows = torch.where(src >= shard.lo, bb * shard.rows + (src - shard.lo), B * shard.rows + bb)
    return idx, rows


def gather_outs(local: dict[str, torch.Tensor], idx: torch.Tensor, total: int,
                shard: Shard) -> dict[str, torch.Tensor]:
    """Every rank's per-slot results, assembled in slot order on every rank."""
    counts = torch.zeros(shard.world, dtype=torch.long, device=idx.device)
    counts[shard.rank] = idx.numel()
    for r in range(shard.world):
        broadcast(counts[r:r + 1], r, shard)
    full = {k: torch.empty(total, dtype=v.dtype, device=v.device) for k, v in local.items()}
    for r in range(shard.world):
        n = int(counts[r])
        if n == 0:
            continue
        ids = idx if r == shard.rank else torch.empty(n, dtype=torch.long, device=idx.device)
        broadcast(ids, r, shard)
        for k, v in local.items():
            part = v if r == shard.rank else torch.empty(n, dtype=v.dtype, device=v.device)
            broadcast(part, r, shard)
            full[k][ids] = part
    return full
