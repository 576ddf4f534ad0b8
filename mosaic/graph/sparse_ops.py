"""Ctx ops of block-sparse attention: the key block estimates (means, channel-wise bounds) and
the sparse attention itself (a layer's layout chosen from them): a part of graph/ctx.Ctx."""

from __future__ import annotations

import torch

from ..config import keep_count
from ..kernels import attention as A
from ..kernels import sparse_select as SS

F32 = torch.float32


class SparseOps:
    def block_means(self, name, x, block: int, group: int = 1):
        """[Hkv, ceil(n / block), hd] fp32 means of x [n, Hkv * group, hd] over blocks of rows
        (and the group's heads): the pooled keys or queries of the sparse-layout estimate."""
        n, h, hd = x.shape
        nb = -(-n // block)
        with self.op("block_means"):
            out = self.new(name, (h // group, nb, hd), torch.float32)
            self.use(x, writes=(out,))
            self.external(nb * (h // group) * hd * 4)          # the mean's result before the copy
            if self.compute:
                SS.block_means_into(out, x, block, group)
        return out

    def block_minmax(self, name, x, block: int):
        """[2, Hkv, ceil(n / block), hd] fp32 channel-wise max ([0]) and min ([1]) of x
        [n, Hkv, hd] over blocks of rows: the key bounds of the minmax sparse-layout estimate."""
        n, h, hd = x.shape
        nb = -(-n // block)
        with self.op("block_minmax"):
            out = self.new(name, (2, h, nb, hd), torch.float32)
            self.use(x, writes=(out,))
            self.external(2 * nb * h * hd * x.element_size())   # the reductions before the copies
            if self.compute:
                SS.block_minmax_into(out, x, block)
        return out

    def attention_sparse(self, name, q, k, v, kpool, rng, block: int, k_total: int, q_block0: int,
                         per_row: bool = False):
        """Block-sparse attention of q [nq, Hq, hd] over k, v [Nk, Hkv, hd] with Mosaic's kernel:
        a layout per key/value head chosen from pooled-query scores against kpool: the key block
        means [Hkv, nkb, hd] or the key block bounds [2, Hkv, nkb, hd] (max, min; the minmax
        estimate) (kernels/sparse_select.py) under the layer's SparseRange `rng` (None: dense), keeping
        up to k_total key blocks per query block. Every buffer, the layout included, is planned;
        only the small top-k sort and pooled-mean results live outside the plan. per_row (the
        rows estimate, kpool the key bounds): every query row is bounded, not the pooled query
        (sparse_select.row_bound_scores_into; its row tiles are charged per op)."""
        nq, hq, hd = q.shape
        hkv, nkb = k.shape[1], kpool.shape[-2]
        nqb = -(-nq // block)
        bounds = kpool.dim() == 4
        with self.op("attention"):
            out = self.new(name, (nq, hq * hd))
            qpool = self.new("qpool", (hkv, nqb, hd), torch.float32)
            scores = self.new("block_scores", (hkv, nqb, nkb), torch.float32)
            top_v = self.new("top_v", (hkv, nqb, k_total), torch.float32)
            top_i = self.new("top_i", (hkv, nqb, k_total), torch.int64)
            idx = self.new("layout_idx", (hkv * nqb * k_total,), torch.int32)
            ptr = self.new("layout_ptr", (hkv, nqb + 1), torch.int32)
            ws = self.new("attn_ws", (max(1, A.workspace_bytes(nq, hq, hd, k.shape[0])),), torch.uint8)
            self.use(q, k, v, kpool, writes=(out, qpool, scores, top_v, top_i, idx, ptr, ws))
            # sort results, means (and the minmax estimate's negative query parts), or row tiles
            est = (SS.rows_tile_bytes(block, hq // hkv, nkb, hd) if per_row
                   else (2 if bounds else 1) * nqb * hkv * hd * 4)
            self.external(2 * hkv * nqb * k_total * 8 + est)
            if self.compute:
                layout = None
                if rng is not None:
                    if per_row:
                        SS.row_bound_scores_into(scores, q, kpool, block)
                    else:
                        SS.block_means_into(qpool, q, block, hq // hkv)
                        if bounds:
                            SS.bound_scores_into(scores, qpool, kpool)
                        else:
                            torch.bmm(qpool, kpool.transpose(1, 2), out=scores)
                    kt = min(nkb, keep_count(rng, nkb), k_total)
                    layout = SS.select_into(scores, q_block0, rng, block, kt, top_v[..., :kt],
                                            top_i[..., :kt], idx[: hkv * nqb * kt], ptr)
                A.attention_into(out, q, k, v, layout=layout, workspace=ws)
        return out

