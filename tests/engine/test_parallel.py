"""Sequence parallelism on 2-3 CPU processes (gloo): the same tokens as one process."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import bundled, random_model

from mosaic import MosaicEngine, load

CASES = [
    ("llada", dict(max_new_tokens=12, steps=6), 1),
    ("llada", dict(max_new_tokens=12, steps=6, block_length=4, temperature=0.7, seed=3), 2),
    ("llada", dict(max_new_tokens=8, steps=8, cfg_scale=1.0, remasking="random", seed=1), 1),
    ("llada_moe", dict(max_new_tokens=10, steps=5), 2),
    ("dream", dict(max_new_tokens=10, steps=5, alg="entropy"), 2),
    ("dream", dict(max_new_tokens=10, steps=10, alg="origin", seed=4), 1),
    ("dream", dict(max_new_tokens=10, steps=5, alg="topk_margin", top_k=9), 2),
]


def prompts(cfg, batch):
    g = torch.Generator().manual_seed(11)
    out = [torch.randint(0, cfg.mask_id - 4, (6 + 4 * i,), generator=g).tolist() for i in range(batch)]
    return out if batch > 1 else out[0]


def make(family):
    return load(bundled("tiny-llada")) if family == "bundled" else random_model(family)


def worker(rank, world, init, family, case, batch, chunks, path, peer_rows=None):
    torch.set_num_threads(1)
    if peer_rows:  # peers' K/V arrive in several pieces per shard
        from mosaic.engine import parallel
        parallel.PEER_ROWS = peer_rows
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = make(family)
        engine = MosaicEngine(model, {"progress": False, "sanitize": True, "chunks": chunks})
        prompt = prompts(model.cfg, batch) if family != "bundled" else ["sort 90817263=", "sort 4411="][:batch]
        out = engine.generate(prompt, **case)
        torch.save(out.tokens, f"{path}.{rank}")
    finally:
        dist.destroy_process_group()


def run(tmp_path, world, family, case, batch, chunks=None, peer_rows=None):
    path = str(tmp_path / "tokens")
    mp.spawn(worker, args=(world, f"file://{tmp_path}/init", family, case, batch, chunks, path,
                           peer_rows), nprocs=world, join=True)
    return [torch.load(f"{path}.{r}") for r in range(world)]


@pytest.mark.parametrize("family, case, batch", CASES,
                         ids=[f"{f}-{'-'.join(f'{k}={v}' for k, v in c.items())}-b{b}" for f, c, b in CASES])
def test_two_ranks_give_the_single_process_tokens(tmp_path, family, case, batch):
    model = make(family)
    one = MosaicEngine(model, {"progress": False}).generate(prompts(model.cfg, batch), **case).tokens
    outs = run(tmp_path, 2, family, case, batch)
    assert all(torch.equal(o, one) for o in outs)


def test_three_ranks_chunked_bundled(tmp_path):
    case = dict(max_new_tokens=8, steps=8)
    engine = MosaicEngine(load(bundled("tiny-llada")), {"progress": False})
    one = engine.generate(["sort 90817263=", "sort 4411="], **case)
    outs = run(tmp_path, 3, "bundled", case, 2, chunks=(2, 3, 2))
    assert all(torch.equal(o, one.tokens) for o in outs)
    assert one.texts[0] == "01236789"


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_peer_shards_in_pieces(tmp_path, family):
    case = dict(max_new_tokens=10, steps=5) if family == "llada" else dict(max_new_tokens=10, steps=5,
                                                                            alg="maskgit_plus")
    model = make(family)
    one = MosaicEngine(model, {"progress": False}).generate(prompts(model.cfg, 2), **case).tokens
    outs = run(tmp_path, 2, family, case, 2, chunks=(2, 1, 1), peer_rows=3)
    assert all(torch.equal(o, one) for o in outs)
