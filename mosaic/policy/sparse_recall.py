"""What each block-sparse pattern keeps of the dense attention: recall and entropy per layer and head.

For one attention call (q [nq, Hq, hd], k [Nk, Hkv, hd], bidirectional, scale 1/sqrt(hd) as
SDPA), the dense softmax probabilities are computed exactly, tile by tile of query rows, and
summed per key block: mass [Hq, nq, nkb] (each row sums to 1). A candidate pattern (a
config.SparseRange) under a block estimate selects its key blocks exactly as the sparse kernel's
layout does (kernels/sparse_select.py: the same estimators, forced window and global blocks,
top-k), and its attention-mass recall of a query row is the dense probability mass that falls in
the kept blocks: 1.0 for keep 1.0, the share of the mass the sparse kernel still sees otherwise
(the sparse kernel renormalises over the kept keys, so 1 - recall is the mass it redistributes).

Entropy: of each row's dense block mass, divided by log(nkb) (0: all mass in one key block,
1: spread evenly), averaged per head: a diffuse head needs many blocks whatever the estimate.

Sources: attention recall of a sparse mask as its quality measure follows the block-sparse
literature (e.g. MInference, Jiang et al. 2024; FlexPrefill, Lai et al. 2025, which picks each
head's pattern from a cumulative-attention threshold); per-layer choice from measured attention
statistics as in SparseD (Wang et al. 2025) for diffusion LLMs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import SparseRange, keep_count
from ..kernels import sparse_select as SS

MASS_TILE_BYTES = 64 * 2**20     # fp32 probabilities per tile of query rows in block_mass


@dataclass(frozen=True)
class Candidate:
    """One pattern a calibration tries for a layer (the fields of config.SparseRange)."""
    pattern: str
    keep: float = 1.0
    window: int = 1
    global_blocks: int = 1

    @property
    def label(self) -> str:
        if self.pattern == "dense":
            return "dense"
        if self.pattern == "topk":
            return f"topk {self.keep:g}"
        if self.pattern == "window":
            return f"window {self.window}"
        return f"global_local {self.global_blocks}+{self.window}"

    def range(self, layers: tuple[int, int]) -> SparseRange:
        return SparseRange(layers, self.pattern, self.keep if self.pattern == "topk" else 1.0,
                           self.window, self.global_blocks)

    def layout_key(self, num_k_blocks: int) -> tuple:
        """Candidates with equal keys select the same blocks at num_k_blocks key blocks (a topk
        keep below the forced blocks is the forced blocks' top-k)."""
        if self.pattern == "dense":
            return ("dense",)
        n = min(num_k_blocks, keep_count(self.range((0, 0)), num_k_blocks))
        return (self.pattern, n, self.window, self.global_blocks)

    def density(self, num_k_blocks: int) -> float:
        """Fraction of the key blocks a query block reads (1.0 dense)."""
        if self.pattern == "dense":
            return 1.0
        return min(num_k_blocks, keep_count(self.range((0, 0)), num_k_blocks)) / num_k_blocks


TOPK_KEEPS = (0.05, 0.1, 0.2, 0.3, 0.5)
DEFAULT_GRID = (Candidate("dense"),
                *(Candidate("topk", k) for k in TOPK_KEEPS),
                Candidate("window", window=1, global_blocks=0), Candidate("window", window=4, global_blocks=0),
                Candidate("global_local", window=1, global_blocks=1),
                Candidate("global_local", window=4, global_blocks=4))


def block_mass(q: torch.Tensor, k: torch.Tensor, block: int) -> torch.Tensor:
    """[Hq, nq, nkb] fp32: the dense softmax(q k^T / sqrt(hd)) probability of each query row
    summed over each block of `block` keys (the last block over its real keys). q [nq, Hq, hd],
    k [Nk, Hkv, hd] (query head h reads key head h // (Hq / Hkv), as reference.attention).
    Exact; tiles of query rows keep the probabilities under MASS_TILE_BYTES."""
    nq, hq, hd = q.shape
    nk, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    nkb = -(-nk // block)
    out = torch.zeros(hq, nq, nkb, dtype=torch.float32, device=q.device)
    kk = k.float().transpose(0, 1)                                      # [Hkv, Nk, hd]
    tile = max(1, MASS_TILE_BYTES // (4 * hq * nkb * block))
    scale = 1.0 / math.sqrt(hd)
    for a in range(0, nq, tile):
        e = min(nq, a + tile)
        qt = q[a:e].float().transpose(0, 1).reshape(hkv, g * (e - a), hd)   # [Hkv, G * t, hd]
        p = torch.softmax(torch.bmm(qt, kk.transpose(1, 2)) * scale, dim=-1)  # [Hkv, G * t, Nk]
        if nkb * block != nk:
            p = torch.nn.functional.pad(p, (0, nkb * block - nk))
        out[:, a:e] = p.view(hkv, g, e - a, nkb, block).sum(-1).reshape(hq, e - a, nkb)
    return out


def key_estimate(k: torch.Tensor, block: int, estimate: str) -> torch.Tensor:
    """The key side of a block estimate, as graph/sparse_ops.py builds it: the channel-wise
    bounds [2, Hkv, nkb, hd] (minmax, rows) or the block means [Hkv, nkb, hd] (mean)."""
    nk, hkv, hd = k.shape
    nkb = -(-nk // block)
    if estimate in ("minmax", "rows"):
        out = torch.empty(2, hkv, nkb, hd, dtype=torch.float32, device=k.device)
        SS.block_minmax_into(out, k.float(), block)
    else:
        out = torch.empty(hkv, nkb, hd, dtype=torch.float32, device=k.device)
        SS.block_means_into(out, k, block)
    return out


def block_scores(q: torch.Tensor, kpool: torch.Tensor, block: int, estimate: str) -> torch.Tensor:
    """[Hkv, nqb, nkb] fp32 block scores of an estimate (sparse_ops.attention_sparse's code)."""
    nq, hq, hd = q.shape
    hkv, nkb = kpool.shape[-3], kpool.shape[-2]
    nqb = -(-nq // block)
    scores = torch.empty(hkv, nqb, nkb, dtype=torch.float32, device=q.device)
    if estimate == "rows":
        SS.row_bound_scores_into(scores, q, kpool, block)
        return scores
    qpool = torch.empty(hkv, nqb, hd, dtype=torch.float32, device=q.device)
    SS.block_means_into(qpool, q, block, hq // hkv)
    if estimate == "minmax":
        SS.bound_scores_into(scores, qpool, kpool)
    else:
        torch.bmm(qpool, kpool.transpose(1, 2), out=scores)
    return scores


def kept_blocks(scores: torch.Tensor, cand: Candidate, block: int, q_block0: int = 0) -> torch.Tensor:
    """[Hkv, nqb, nkb] bool: the key blocks the sparse kernel reads under `cand`, selected by
    sparse_select.select_into from the estimate's scores (not modified); all True when dense."""
    hkv, nqb, nkb = scores.shape
    if cand.pattern == "dense":
        return torch.ones(hkv, nqb, nkb, dtype=torch.bool, device=scores.device)
    rng = cand.range((0, 0))
    kt = min(nkb, keep_count(rng, nkb))
    top_v = torch.empty(hkv, nqb, kt, dtype=torch.float32, device=scores.device)
    top_i = torch.empty(hkv, nqb, kt, dtype=torch.int64, device=scores.device)
    idx = torch.empty(hkv * nqb * kt, dtype=torch.int32, device=scores.device)
    ptr = torch.empty(hkv, nqb + 1, dtype=torch.int32, device=scores.device)
    SS.select_into(scores.clone(), q_block0, rng, block, kt, top_v, top_i, idx, ptr)
    kept = torch.zeros(hkv, nqb, nkb, dtype=torch.bool, device=scores.device)
    kept.scatter_(2, idx.view(hkv, nqb, kt).long(), True)
    return kept


def recall(mass: torch.Tensor, kept: torch.Tensor, block: int) -> torch.Tensor:
    """[Hq, nq] fp32: each query row's dense attention mass inside its query block's kept key
    blocks. mass [Hq, nq, nkb] from block_mass; kept [Hkv, nqb, nkb] from kept_blocks."""
    hq, nq, nkb = mass.shape
    hkv = kept.shape[0]
    rows = kept.repeat_interleave(hq // hkv, dim=0).repeat_interleave(block, dim=1)[:, :nq]   # [Hq, nq, nkb]
    return (mass * rows).sum(-1)


def block_entropy(mass: torch.Tensor) -> torch.Tensor:
    """[Hq] mean over rows of the entropy of each row's block mass, over log(nkb) (0 to 1)."""
    nkb = mass.shape[-1]
    if nkb < 2:
        return torch.zeros(mass.shape[0])
    h = -(mass * mass.clamp_min(1e-30).log()).sum(-1)                   # [Hq, nq]
    return h.mean(-1) / math.log(nkb)


def attention_stats(q: torch.Tensor, k: torch.Tensor, block: int, candidates, estimates,
                    rows: torch.Tensor | None = None) -> dict:
    """The statistics of one attention call: {"entropy": [Hq], "rows": n, "masked_rows": m,
    (estimate, label): {"all": [Hq] recall summed over rows, "masked": [Hq] summed over
    `rows` (the query rows of masked positions, int64 [m]; none: zeros)}}. Sums, so calls
    add up; divide by the row counts for means."""
    mass = block_mass(q, k, block)
    out = {"entropy": block_entropy(mass) * q.shape[0], "rows": q.shape[0],
           "masked_rows": 0 if rows is None else int(rows.numel())}
    dense = None
    for est in estimates:
        scores = block_scores(q, key_estimate(k, block, est), block, est)
        for cand in candidates:
            if cand.pattern == "dense" and dense is not None:
                out[(est, cand.label)] = dense
                continue
            r = recall(mass, kept_blocks(scores, cand, block), block)     # [Hq, nq]
            rec = {"all": r.sum(-1), "masked": r[:, rows].sum(-1) if rows is not None and rows.numel()
                   else torch.zeros(r.shape[0])}
            if cand.pattern == "dense":
                dense = rec
            out[(est, cand.label)] = rec
    return out
