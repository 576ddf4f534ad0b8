"""PyTorch oracle of the attention kernel (attention_triton.py): the CPU path and the test oracle.

Plain float32 softmax attention, one key/value head and one tile of query rows at a time, so a
call never holds more than `tile_elems` scores (16M fp32 = 64 MiB) however long the sequence:
no [nq, Nk] matrix. Dense or block-sparse (the layout turned into a boolean block mask).
"""

from __future__ import annotations

import math

import torch

from .attention_layout import BlockLayout

TILE_ELEMS = 1 << 24   # fp32 scores per tile: 64 MiB


def attention_ref(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  lse: torch.Tensor | None = None, layout: BlockLayout | None = None,
                  scale: float | None = None, tile_elems: int = TILE_ELEMS) -> None:
    """Bidirectional softmax(q k^T * scale) v, in fp32, written into out (its dtype).

    q [nq, Hq, hd]; k, v [Nk, Hkv, hd] with Hq = G * Hkv (query head h reads kv head h // G);
    out [nq, Hq * hd] (any row stride); lse: optional fp32 [Hq, nq], natural-log log-sum-exp
    of the scaled scores per (head, row). layout: block-sparse pattern (attention_layout.py);
    rows that read no key get out = 0 and lse = -inf. scale defaults to 1 / sqrt(hd)."""
    nq, hq, hd = q.shape
    nk, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    o3 = out.view(nq, hq, hd) if out.dim() == 2 else out
    bmask = layout.block_mask() if layout is not None else None
    key_blk = torch.arange(nk, device=q.device) // layout.block_k if layout is not None else None
    rows = max(1, tile_elems // max(1, g * nk))
    for h in range(hkv):
        kh, vh = k[:, h].float(), v[:, h].float()                       # [Nk, hd]
        heads = slice(h * g, (h + 1) * g)
        for a in range(0, nq, rows):
            b = min(nq, a + rows)
            s = torch.einsum("qgd,kd->gqk", q[a:b, heads].float(), kh) * scale   # [G, t, Nk]
            if bmask is not None:
                qb = torch.arange(a, b, device=q.device) // layout.block_q
                lh = torch.arange(h * g, (h + 1) * g) if layout.heads_per_layout == "q" else torch.tensor([h])
                allowed = bmask[lh.to(bmask.device)][:, qb][:, :, key_blk]         # [G or 1, t, Nk]
                s.masked_fill_(~allowed, float("-inf"))
            m = s.logsumexp(-1)                                         # [G, t], -inf if no key
            p = torch.exp(s - m.clamp_min(torch.finfo(torch.float32).min)[..., None])  # 0 where -inf
            o3[a:b, heads] = torch.einsum("gqk,kd->qgd", p, vh).to(out.dtype)
            if lse is not None:
                lse[heads, a:b] = m


def pooled_block_scores(q: torch.Tensor, k: torch.Tensor, block_q: int, block_k: int,
                        scale: float | None = None) -> torch.Tensor:
    """The cheap block-importance estimate used to pick sparse layouts: mean of each query block's
    rows dotted with the mean of each key block's rows, times scale (1/sqrt(hd)).

    q [nq, Hq, hd]; k [Nk, Hkv, hd] -> fp32 [Hq, ceil(nq / block_q), ceil(Nk / block_k)]
    (the last block of each is the mean over its real rows). Pools in fp32 over row tiles: the
    only large temporary is one tile's fp32 copy."""
    hq, hd = q.shape[1], q.shape[2]
    g = hq // k.shape[1]
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    qm = _block_means(q, block_q)                                      # [nqb, Hq, hd]
    km = _block_means(k, block_k).repeat_interleave(g, dim=1)          # [nkb, Hq, hd]
    return torch.einsum("ihd,jhd->hij", qm, km) * scale


def _block_means(x: torch.Tensor, block: int, tile: int = 4096) -> torch.Tensor:
    n, h, d = x.shape
    nb = -(-n // block)
    acc = torch.zeros(nb, h, d, dtype=torch.float32, device=x.device)
    for a in range(0, n, tile):
        b = min(n, a + tile)
        acc.index_add_(0, torch.arange(a, b, device=x.device) // block, x[a:b].float())
    counts = torch.full((nb,), float(block), device=x.device)
    counts[-1] = n - (nb - 1) * block
    return acc / counts[:, None, None]
