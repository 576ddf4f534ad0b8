"""Admission under sequence parallelism: the capacity planner and run-time admission agree
exactly for any number of ranks, and every rank reaches the same decision."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import random_model

from mosaic import GenerationConfig, MemoryBudgetError, MosaicEngine
from mosaic.config import EngineConfig
from mosaic.graph.shard import Shard
from mosaic.memory.accounting import FIXED_BYTES, Budget
from mosaic.policy.admitter import Admitter, scaled
from mosaic.policy.capacity import capacity_preparer, capacity_report
from mosaic.runtime.samplers import sampler_for

ROOM = 3 * 2**20   # activation bytes: a few thousand tokens of the tiny model per rank


def budget_for(model) -> int:
    return model.weight_bytes() + FIXED_BYTES + ROOM


def plan_l_max(model, world: int) -> int:
    """`mosaic plan --gpus world` for this CPU process (no context, CPU kernel choices)."""
    return capacity_report(model, budget_for(model), context_bytes=0, target="cpu", ratios=(1.0,),
                           world=world)["l_max"]


def admitted(model, world: int, n: int) -> tuple[bool, int]:
    """What run-time admission decides on `world` ranks for a request of n tokens, half of them
    generated: every rank fits its own share (else all refuse), and the longest that fits is
    the shortest of the ranks' longest (the engine's agree step, here without processes)."""
    bud = Budget.build(budget_for(model), model.weight_bytes(), 0, FIXED_BYTES, cuda=False)   # a CPU engine
    prep = capacity_preparer(model, bud, target="cpu")   # the engine's Preparer on this CPU
    gen = GenerationConfig(max_new_tokens=n // 2)
    oks, bests = [], []
    for rank in range(world):
        adm = Admitter(model, EngineConfig(device="cpu"), prep, lambda off: bud, lambda g: sampler_for(model.cfg, g),
                       shards=lambda length, rank=rank: [Shard.of(length, rank, world) if world > 1 else None],
                       world=world)   # the engine's current() shard
        ok = adm.fits(1, n, gen)
        oks.append(ok)
        if not ok:
            bests.append(adm.longest(1, scaled(gen, n), hi=n))
    return all(oks), (min(bests) if bests else n)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_planner_and_admission_agree_for_any_world_size(world):
    model = random_model("llada")
    L = plan_l_max(model, world)
    assert L >= 1024
    assert admitted(model, world, L)[0]
    ok, best = admitted(model, world, L + 1024)
    assert not ok and L <= best < L + 1024
    if world > 1:   # more ranks hold more
        assert L > plan_l_max(model, world - 1)


def _admit_worker(rank, world, init, n, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = random_model("llada")
        engine = MosaicEngine(model, {"progress": False, "memory_budget": budget_for(model)})
        res = [engine.admit(1, n, GenerationConfig(max_new_tokens=n // 2)).predicted_bytes]
        try:
            engine.admit(1, n + 1024, GenerationConfig(max_new_tokens=(n + 1024) // 2))
            res.append(None)
        except MemoryBudgetError as e:
            res.append((str(e), e.max_tokens))
        torch.save(res, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_every_rank_admits_the_planned_l_max_and_refuses_beyond_it(tmp_path, world):
    model = random_model("llada")
    L = plan_l_max(model, world)
    out = str(tmp_path / "adm")
    mp.spawn(_admit_worker, args=(world, f"file://{tmp_path}/init", L, out), nprocs=world, join=True)
    res = [torch.load(f"{out}.{r}") for r in range(world)]
    refusals = [r[1] for r in res]
    assert all(r == refusals[0] for r in refusals)          # the same error on every rank
    message, best = refusals[0]
    assert L <= best < L + 1024
    assert best == admitted(model, world, L + 1024)[1]     # the emulation above is the engine's
    assert f"longest that fits on {world} GPUs: {best:,} tokens" in message and "per GPU" in message


def _chunk_worker(rank, world, init, out):
    """A budget tight enough that every phase is split, with the canvas at the end: the last
    rank holds every masked row, the others none (different masked counts per rank)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = random_model("llada")
        engine = MosaicEngine(model, {"progress": False, "sanitize": True,
                                      "memory_budget": model.weight_bytes() + FIXED_BYTES + 60_000})
        prompt = torch.randint(0, 30, (200,), generator=torch.Generator().manual_seed(0)).tolist()
        gen = engine.generate(prompt, max_new_tokens=24, steps=6)
        torch.save((gen.tokens, [s.chunks for s in engine.history]), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_with_different_masked_counts_run_the_same_attention_chunks(tmp_path):
    out, world = str(tmp_path / "chunks"), 3
    mp.spawn(_chunk_worker, args=(world, f"file://{tmp_path}/init", out), nprocs=world, join=True)
    res = [torch.load(f"{out}.{r}") for r in range(world)]
    attn = [[c[0] for c in chunks] for _, chunks in res]
    assert attn[0] == attn[1] == attn[2] and max(attn[0]) > 1   # split, and alike on every rank
    model = random_model("llada")
    engine = MosaicEngine(model, {"progress": False})
    prompt = torch.randint(0, 30, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    one = engine.generate(prompt, max_new_tokens=24, steps=6).tokens
    assert all(torch.equal(t, one) for t, _ in res)
