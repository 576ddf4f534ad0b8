"""The ring attention of sequence parallelism on 2-3 gloo processes: overlapped transfers give
bit for bit the result of the non-overlapped ring, which matches attention over all keys."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mosaic.graph.ring import ring_attend
from mosaic.graph.shard import Shard
from mosaic.kernels import reference as R

HQ, HKV, HD = 4, 2, 8   # grouped-query heads, as Dream


def _ring(rank, world, n, nq, piece, pad):
    g = torch.Generator().manual_seed(5)
    K, V = (torch.randn(n, HKV * HD, generator=g) for _ in range(2))
    q = torch.randn(nq[rank], HQ, HD, generator=g)
    res = {}
    for overlap in (True, False):
        sh = Shard.of(n, rank, world, piece_rows=piece, overlap=overlap)
        k, v = K[sh.lo:sh.hi].clone(), V[sh.lo:sh.hi].clone()
        p = sh.piece(piece)
        kvp = torch.full((sh.slots, p, 2 * HKV * HD), float("nan"))
        acc = torch.full((q.shape[0], HQ, HD), float("nan"))
        lse = torch.full((HQ, q.shape[0]), float("nan"))
        o = torch.empty(q.shape[0], HQ * HD)
        for _ in range(2):   # two query chunks in a row reuse the slots
            ring_attend(o, q, k, v, kvp, acc, lse, sh, pad)
        res[overlap] = o.clone()
    want = torch.empty(q.shape[0], HQ * HD)
    R.attention(want, q, K[pad:].view(-1, HKV, HD), V[pad:].view(-1, HKV, HD))
    return res, want


def _worker(rank, world, init, cases, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.save([_ring(rank, world, *c) for c in cases], f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world, cases", [
    (2, [(23, (5, 7), 4, 0),        # several pieces per shard, uneven
         (10, (4, 4), 16, 6)]),     # one piece per shard, padding inside rank 1's shard
    (3, [(31, (6, 0, 9), 3, 7)]),   # a rank with no query rows; padding over whole pieces
])
def test_overlapped_ring_is_the_plain_ring_bit_for_bit(tmp_path, world, cases):
    out = str(tmp_path / "ring")
    mp.spawn(_worker, args=(world, f"file://{tmp_path}/init", cases, out), nprocs=world, join=True)
    for r in range(world):
        for res, want in torch.load(f"{out}.{r}"):
            assert torch.equal(res[True], res[False])
            torch.testing.assert_close(res[True], want, rtol=1e-5, atol=1e-5)


def test_piece_schedule_is_the_same_on_every_rank_and_covers_every_row():
    shards = [Shard.of(41, r, 3, piece_rows=100) for r in range(3)]
    piece = shards[0].piece(5)          # query chunks of 5 rows: pieces of 5
    assert piece == 5 and all(s.piece(5) == piece for s in shards)
    sched = shards[0].pieces(piece)
    assert all(s.pieces(piece) == sched for s in shards[1:])
    for src, (lo, hi) in enumerate(shards[0].bounds):
        mine = [(a, b) for s, a, b in sched if s == src]
        assert mine[0][0] == 0 and mine[-1][1] == hi - lo
        assert all(b - a <= piece for a, b in mine)
        assert all(mine[i][1] == mine[i + 1][0] for i in range(len(mine) - 1))
    assert Shard.of(41, 0, 3, overlap=False).slots == 1 and shards[0].slots == 2
