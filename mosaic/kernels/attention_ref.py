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
                  scale: float | None = None, tile_elems: int = TILE_ELEMS, gather: bool = True) -> None:
    """Bidirectional softmax(q k^T * scale) v, in fp32, written into out (its dtype).

    q [nq, Hq, hd]; k, v [Nk, Hkv, hd] with Hq = G * Hkv (query head h reads kv head h // G);
    out [nq, Hq * hd] (any row stride); lse: optional fp32 [Hq, nq], natural-log log-sum-exp
    of the scaled scores per (head, row). layout: block-sparse pattern (attention_layout.py);
    rows that read no key get out = 0 and lse = -inf. scale defaults to 1 / sqrt(hd).
    gather (default): a layout that keeps the same number of key blocks for every query block
    (what sparse_select makes) is computed over the gathered kept blocks only, so the CPU pays
    the layout's density, not dense attention plus a mask; False (tests) or any other layout:
    dense scores with the disallowed blocks masked."""
    nq, hq, hd = q.shape
    nk, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    o3 = out.view(nq, hq, hd) if out.dim() == 2 else out
    kt = _uniform(layout) if layout is not None and gather else None
    if kt is not None:
        _sparse_gather(o3, q, k, v, lse, layout, kt, scale, tile_elems)
        return
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


def _uniform(layout: BlockLayout) -> int | None:
    """Blocks kept per query block when every query block (of every head) keeps the same number
    and query and key blocks have one size, else None."""
    if layout.block_q != layout.block_k:
        return None
    counts = layout.indptr[:, 1:] - layout.indptr[:, :-1]
    kt = int(counts[0, 0]) if counts.numel() else 0
    if kt == 0 or not bool((counts == kt).all()):
        return None
    return kt


def _sparse_gather(o3, q, k, v, lse, layout: BlockLayout, kt: int, scale: float, tile_elems: int) -> None:
    """attention_ref over each query block's kept key blocks only (a uniform layout keeping kt
    blocks per query block): K and V padded to whole blocks ([Hkv, nkb, b, hd] fp32, pad keys
    masked), gathered per query block ([., kt * b, hd]), over tiles of query blocks bounded by
    tile_elems scores."""
    nq, hq, hd = q.shape
    nk, hkv = k.shape[0], k.shape[1]
    g, b = hq // hkv, layout.block_k
    nqb, nkb = -(-nq // b), -(-nk // b)
    per_q = layout.heads_per_layout == "q"
    idx_all = torch.stack([layout.indices[int(layout.indptr[h, 0]):int(layout.indptr[h, -1])].long().view(nqb, kt)
                           for h in range(layout.indptr.shape[0])])            # [H_l, nqb, kt]
    valid = (torch.arange(nkb * b, device=q.device) < nk).view(nkb, b)
    tq = max(1, tile_elems // max(1, g * b * kt * b))                          # query blocks per tile
    for h in range(hkv):
        kp = torch.zeros(nkb * b, hd, device=k.device, dtype=torch.float32)
        vp = torch.zeros_like(kp)
        kp[:nk], vp[:nk] = k[:, h], v[:, h]
        kp, vp = kp.view(nkb, b, hd), vp.view(nkb, b, hd)
        for i0 in range(0, nqb, tq):
            i1 = min(nqb, i0 + tq)
            a, e = i0 * b, min(nq, i1 * b)
            qt = torch.zeros((i1 - i0) * b, g, hd, device=q.device, dtype=torch.float32)
            qt[: e - a] = q[a:e, h * g:(h + 1) * g]
            qt = qt.view(i1 - i0, b, g, hd).permute(0, 2, 1, 3)               # [t, G, b, hd]
            heads = [h * g + j for j in range(g)] if per_q else [h]
            outs, lses = [], []
            for j, lh in enumerate(heads):
                idx = idx_all[lh, i0:i1]                                       # [t, kt]
                kg = kp[idx].reshape(i1 - i0, kt * b, hd)
                vg = vp[idx].reshape(i1 - i0, kt * b, hd)
                qh = qt[:, j:j + 1] if per_q else qt                           # [t, G or 1, b, hd]
                s = torch.einsum("tgqd,tkd->tgqk", qh, kg) * scale
                s.masked_fill_(~valid[idx].reshape(i1 - i0, 1, 1, kt * b), float("-inf"))
                m = s.logsumexp(-1)                                            # [t, G or 1, b]
                outs.append(torch.einsum("tgqk,tkd->tgqd", torch.exp(s - m[..., None]), vg))
                lses.append(m)
            o, m = torch.cat(outs, 1), torch.cat(lses, 1)                      # [t, G, b, hd], [t, G, b]
            o3[a:e, h * g:(h + 1) * g] = o.permute(0, 2, 1, 3).reshape(-1, g, hd)[: e - a].to(o3.dtype)
            if lse is not None:
                lse[h * g:(h + 1) * g, a:e] = m.permute(1, 0, 2).reshape(g, -1)[:, : e - a]


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
