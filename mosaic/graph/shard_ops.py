"""Ctx ops of sequence parallelism: attention over every rank's K/V shard (the ring) and the
one-row halo of Dream's shifted logits: a part of graph/ctx.Ctx."""

from __future__ import annotations

import torch

from ..kernels import reference as R
from .ring import ring_attend
from .shard import broadcast

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

