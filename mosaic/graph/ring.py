"""Ring attention over sequence shards: every rank's K/V shard streamed past the local queries
in pieces, partial attention merged in log-sum-exp form, the next piece in flight while the
current one is attended.

The schedule (Shard.pieces) is the same on every rank: source rank by source rank, each shard
cut into pieces of at most `piece` rows. A piece's owner packs its K and V rows into one of its
receive slots and broadcasts the slot (one collective per piece: the host work per piece is what
bounds small pieces); the others receive it into the same slot. With two slots
(Shard.overlap) piece i+1's broadcast is posted before piece i is attended:

  NCCL  the broadcast runs on NCCL's own stream; PyTorch makes that stream wait for the work
        already queued on the current stream when the broadcast is posted (so slot (i+1) % 2 is
        not overwritten before piece i-1, its previous content, has been attended), and
        work.wait() makes the current stream wait for the piece before attending it. NCCL's
        kernels take a few SMs while attention runs; the copy itself hides behind the math
        whenever a query chunk has more than ~700 rows (2 ranks; `python -m bench multi_gpu`).
  gloo  the broadcast runs on gloo's threads while this thread computes; wait() blocks.

The arithmetic (pieces, merge order, roundings) does not depend on the overlap: with one slot
every broadcast simply completes before its piece is used, and the result is bit-identical
(tests/engine/test_ring.py). Source: ring attention (Liu, Zaharia, Abbeel 2023) in its broadcast
form; the log-sum-exp merge is FlashAttention's online softmax (Dao et al. 2022) across blocks.
"""

from __future__ import annotations

import torch

from ..kernels import reference as R
from ..kernels.merge import merge_partial
from .shard import Shard, broadcast


def ring_attend(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # noqa: C901
                kv_peer: torch.Tensor, acc: torch.Tensor, lse: torch.Tensor, shard: Shard, pad: int) -> None:
    """out [nq, Hq*hd] = attention of q [nq, Hq, hd] over the keys of every rank's shard.

    k, v: this rank's K/V [rows, kv_dim]; kv_peer: receive slots [slots, piece, 2 * kv_dim], a
    piece's K then V in each row, so that one broadcast carries both (the owner packs its own
    piece into the slot first); acc fp32 [nq, Hq, hd], lse fp32 [Hq, nq]: the running merge
    (planned buffers); pad: keys before this global position are not attended (left padding).
    Every rank must call this the same number of times with the same piece size (the
    broadcasts are collectives); a rank with no query rows still takes part. out may be q's own
    buffer (q is not read after the last piece)."""
    nq, hq, hd = q.shape
    slots, piece, kv2 = kv_peer.shape
    kv = kv2 // 2
    sched = shard.pieces(piece)
    overlap = slots > 1

    def post(i: int):
        src, a, b = sched[i]
        slot = kv_peer[i % slots, : b - a]
        if src == shard.rank:     # pack this rank's piece (queued before the broadcast reads it)
            slot[:, :kv].copy_(k[a:b])
            slot[:, kv:].copy_(v[a:b])
        return broadcast(slot, src, shard, async_op=overlap)

    first = True
    work = post(0)
    for i, (src, a, b) in enumerate(sched):
        if work is not None:
            work.wait()
        n = b - a
        if src == shard.rank:
            ks, vs = k[a:b], v[a:b]
        else:
            slot = kv_peer[i % slots, :n]
            ks, vs = slot[:, :kv], slot[:, kv:]
        more = i + 1 < len(sched)
        if more and overlap:   # piece i+1 travels into the other slot while piece i is attended
            work = post(i + 1)
        start = min(max(pad - shard.bounds[src][0] - a, 0), n)   # keys before the padding's end
        if start < n and nq:
            o, l_ = R.attention_partial(q, ks[start:].view(n - start, -1, hd),
                                        vs[start:].view(n - start, -1, hd), native=True)
            if first:   # == merging into an empty accumulator (0 * 0 + o * 1), without zeroing it
                acc.copy_(o)
                lse.copy_(l_)
                first = False
            else:
                merge_partial(acc, lse, o, l_)
            del o, l_
        if more and not overlap:   # one slot: the next piece arrives after this one is used
            work = post(i + 1)
    if nq:
        out.view(nq, hq, hd).copy_(acc)
