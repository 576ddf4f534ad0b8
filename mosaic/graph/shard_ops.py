"""Ctx ops of several processes: under sequence parallelism, attention over every rank's K/V
shard (the ring) and the one-row halo of Dream's shifted logits; under tensor parallelism, the
sum of a row-parallel projection's partials (tp_reduce). A part of graph/ctx.Ctx."""

from __future__ import annotations

import torch

from ..kernels import reference as R
from .ring import ring_attend
from .shard import broadcast
from .tensor import reduce_partials

F32 = torch.float32


class ShardOps:
    def ring_attention(self, q, k, v, kv_peer, shard, pad):
        """Attention of local queries q [nq, Hq, hd] against every rank's K/V shard (sequence
        parallelism, graph/ring.py): pieces broadcast into the receive slots kv_peer
        [slots, piece, 2 * kv_dim], partial results merged in log-sum-exp form into a planned
        fp32 accumulator. Keys before `pad` (left padding) are never attended. The result is
        written over q (not read after the last piece) and returned as [nq, Hq*hd]."""
        nq, hq, hd = q.shape
        with self.op("attention"):
            acc = self.new("ring_acc", (nq, hq, hd), F32)
            lse = self.new("ring_lse", (hq, nq), F32)
            self.use(q, k, v, writes=(kv_peer, acc, lse))
            self.external(R.partial_bytes(nq, hq, k.shape[1] // hd, hd, q.element_size()))
            out = q.view(nq, hq * hd)
            if self.compute:
                ring_attend(out, q, k, v, kv_peer, acc, lse, shard, pad)
        return out

    def halo(self, x, body, shard, batch):
        """Row j-1 for the first position of each shard (Dream's shift): the last final-normed
        row of the previous rank's slice of every sequence, written after the body rows."""
        with self.op("halo"):
            self.use(body, writes=(x,))
            self.external(x.shape[1] * x.element_size())
            if self.compute:
                rows = shard.rows
                if shard.rank == 0:  # no previous rank: defined bytes, never read by a slot
                    x[batch * rows:].zero_()
                tmp = torch.empty(x.shape[1], dtype=x.dtype, device=x.device)
                for b in range(batch):
                    for src in range(shard.world - 1):
                        if src == shard.rank:
                            tmp.copy_(body[b * rows + rows - 1])
                        broadcast(tmp, src, shard)
                        if src + 1 == shard.rank:
                            x[batch * rows + b].copy_(tmp)


    def tp_reduce(self, y, shard):
        """Tensor parallelism: the partial sums y [n, d] of a row-parallel projection (o or
        down) summed over every rank, in place (graph/tensor.reduce_partials: all-gather into a
        planned [world, n, d] buffer, fixed rank order, float32 sum)."""
        n, d = y.shape
        with self.op("tp_reduce"):
            parts = self.new("tp_parts", (shard.world, n, d), y.dtype)
            acc = None if y.dtype == F32 else self.new("tp_acc", (n, d), F32)
            self.use(y, writes=(parts,) if acc is None else (parts, acc))
            if self.compute:
                reduce_partials(y, parts, acc, shard)
        return y
