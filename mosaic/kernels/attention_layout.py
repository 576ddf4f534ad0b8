"""The block-sparse attention layout: which key blocks each query block reads, per head (CSR).

One format serves the Triton kernel (attention_triton.py), its oracle (attention_ref.py) and
whoever picks the pattern. Query block i of layout head h reads the key blocks

    indices[indptr[h, i] : indptr[h, i + 1]]

where indptr values are offsets into the one flat `indices` array of every head (row-major over
(head, query block), so indptr[h, num_q_blocks] == indptr[h + 1, 0]). Query block i covers query
rows [i * block_q, (i + 1) * block_q), key block j keys [j * block_k, (j + 1) * block_k), the
last of each clipped to nq / Nk. A layout head is a query head (heads_per_layout='q', Hq rows) or
a key/value head shared by its G = Hq / Hkv query heads ('kv', Hkv rows).

A query block with no key blocks attends to nothing: its output rows are 0 and its log-sum-exp
is -inf (so it merges as "no contribution").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockLayout:
    block_q: int              # query rows per layout block (a power of two >= 16)
    block_k: int              # keys per layout block (a power of two >= 16)
    indptr: torch.Tensor      # [H_layout, num_q_blocks + 1] int32 or int64, offsets into indices
    indices: torch.Tensor     # [nnz] int32 key block ids, ascending within each (head, query block)
    heads_per_layout: str     # 'q': one row per query head; 'kv': one per key/value head
    num_k_blocks: int         # ceil(Nk / block_k): the key length the layout was made for

    @property
    def num_heads(self) -> int:
        return self.indptr.shape[0]

    @property
    def num_q_blocks(self) -> int:
        return self.indptr.shape[1] - 1

    @property
    def nnz(self) -> int:
        return self.indices.shape[0]

    def density(self) -> float:
        """Fraction of (head, query block, key block) tiles computed: 1.0 is dense."""
        return self.nnz / max(1, self.num_heads * self.num_q_blocks * self.num_k_blocks)

    def block_mask(self) -> torch.Tensor:
        """[H_layout, num_q_blocks, num_k_blocks] bool: True where a tile is computed."""
        h, nqb, nkb = self.num_heads, self.num_q_blocks, self.num_k_blocks
        ip = self.indptr.long()
        counts = (ip[:, 1:] - ip[:, :-1]).reshape(-1)
        rows = torch.repeat_interleave(torch.arange(h * nqb, device=ip.device), counts)
        # rows are stored in (head, query block) order, so their entries are one contiguous run
        cols = self.indices[int(ip[0, 0]): int(ip[-1, -1])].long()
        mask = torch.zeros(h * nqb, nkb, dtype=torch.bool, device=self.indices.device)
        mask[rows.to(mask.device), cols] = True
        return mask.view(h, nqb, nkb)

    def check(self, nq: int, nk: int, hq: int, hkv: int) -> None:
        """Raise ValueError unless the layout fits q [nq, Hq, hd] and k [Nk, Hkv, hd]."""
        want_h = hq if self.heads_per_layout == "q" else hkv
        if self.heads_per_layout not in ("q", "kv"):
            raise ValueError(f"heads_per_layout must be 'q' or 'kv', not {self.heads_per_layout!r}")
        for name, b in (("block_q", self.block_q), ("block_k", self.block_k)):
            if b < 16 or b & (b - 1):
                raise ValueError(f"{name} must be a power of two >= 16, not {b}")
        nqb, nkb = -(-nq // self.block_q), -(-nk // self.block_k)
        if tuple(self.indptr.shape) != (want_h, nqb + 1):
            raise ValueError(f"indptr is {tuple(self.indptr.shape)}, want ({want_h}, {nqb + 1}) for "
                             f"nq={nq}, block_q={self.block_q}, heads_per_layout={self.heads_per_layout!r}")
        if self.num_k_blocks != nkb:
            raise ValueError(f"layout made for {self.num_k_blocks} key blocks, keys give {nkb}")
        if self.indptr.dtype not in (torch.int32, torch.int64) or self.indices.dtype != torch.int32:
            raise ValueError("indptr must be int32/int64 and indices int32")


def layout_from_mask(mask: torch.Tensor, block_q: int, block_k: int, heads_per_layout: str = "q") -> BlockLayout:
    """mask [H_layout, num_q_blocks, num_k_blocks] bool -> BlockLayout (indices sorted per row)."""
    h, nqb, nkb = mask.shape
    flat = mask.reshape(h * nqb, nkb)
    counts = flat.sum(-1)
    cum = torch.zeros(h * nqb + 1, dtype=torch.int64, device=mask.device)
    torch.cumsum(counts, 0, out=cum[1:])
    # head h's row i starts at cum[h * nqb + i]; its last entry repeats as the next head's first
    gather = torch.arange(h, device=mask.device)[:, None] * nqb + torch.arange(nqb + 1, device=mask.device)
    indptr = cum[gather].to(torch.int32 if int(cum[-1]) < 2**31 else torch.int64)
    indices = flat.nonzero()[:, 1].to(torch.int32)   # row-major: ascending within each row
    return BlockLayout(block_q, block_k, indptr.contiguous(), indices.contiguous(), heads_per_layout, nkb)


def layout_from_scores(scores: torch.Tensor, block_q: int, block_k: int, keep: float,
                       heads_per_layout: str = "q", diagonal: bool = True) -> BlockLayout:
    """Top-k key blocks per (head, query block) by score [H, nqb, nkb], k = ceil(keep * nkb);
    diagonal=True also keeps key block i for query block i (when it exists)."""
    h, nqb, nkb = scores.shape
    k = max(1, min(nkb, int(-(-keep * nkb // 1))))
    mask = torch.zeros(h, nqb, nkb, dtype=torch.bool, device=scores.device)
    mask.scatter_(-1, scores.topk(k, dim=-1).indices, True)
    if diagonal:
        i = torch.arange(min(nqb, nkb), device=scores.device)
        mask[:, i, i] = True
    return layout_from_mask(mask, block_q, block_k, heads_per_layout)


def random_layout(h: int, nq: int, nk: int, block_q: int, block_k: int, density: float,
                  heads_per_layout: str = "q", diagonal: bool = True, seed: int = 0,
                  device="cpu") -> BlockLayout:
    """A random layout of about `density` (benchmarks and tests); diagonal blocks always kept."""
    nqb, nkb = -(-nq // block_q), -(-nk // block_k)
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(h, nqb, nkb, generator=g)
    return layout_from_scores(scores.to(device), block_q, block_k, density, heads_per_layout, diagonal)
