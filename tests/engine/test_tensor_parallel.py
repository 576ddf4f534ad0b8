"""Tensor parallelism on 2 CPU processes (gloo, float32): every rank holds half of each layer's
heads and FFN columns, and the tokens are those of one process (docs/PARALLEL.md)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import random_model
from ranks import batch_inputs

from mosaic import MosaicEngine
from mosaic.errors import MemoryBudgetError
from mosaic.graph.ctx import EagerCtx
from mosaic.graph.tensor import TensorShard
from mosaic.models.layers import step_program
from mosaic.models.step import make_step
from mosaic.models.tensor_shard import shard_model

TP = {"progress": False, "sanitize": True, "parallel": "tensor"}


def worker(rank, world, init, cases, path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    out = []
    try:
        for family, case, batch, opts in cases:
            model = random_model(family[0], **family[1]) if isinstance(family, tuple) else random_model(family)
            if case == "logits":     # one eager forward of the rank's share: full logits [N, V]
                out.append({"logits": full_logits(shard_model(model, TensorShard(rank, world)))})
                continue
            try:
                engine = MosaicEngine(model, {**TP, **opts})
                gen = engine.generate(**batch_inputs(family, model, batch), **case)
            except (MemoryBudgetError, ValueError) as e:   # InputError is a ValueError
                out.append({"error": f"{type(e).__name__}: {e}"})
                continue
            lw = engine.model.layers[0]
            out.append({"tokens": gen.tokens, "world": engine.model.tensor.world,
                        "layer_bytes": sum(t.numel() * t.element_size() for t in lw.values()),
                        "plan_bytes": max(h.plan_bytes for h in engine.history)})
    finally:
        dist.destroy_process_group()
    torch.save(out, f"{path}.{rank}")


def full_logits(model) -> torch.Tensor:
    ids = torch.randint(0, model.cfg.mask_id + 1, (2, 24), generator=torch.Generator().manual_seed(5))
    return step_program(EagerCtx(model.device, model.dtype), model, make_step(model.cfg, ids, None))


def run_cases(tmp_path, cases, world=2):
    """Each rank's results, case by case: [rank][case] -> dict (tokens, or error text)."""
    path = str(tmp_path / "out")
    mp.spawn(worker, args=(world, f"file://{tmp_path}/init", cases, path), nprocs=world, join=True)
    return [torch.load(f"{path}.{r}") for r in range(world)]


def one_process(family, case, batch, opts=None):
    """family: a name, or (name, {config field: value}) for a variant of its tiny model; opts:
    engine options (as the ranks')."""
    model = random_model(family[0], **family[1]) if isinstance(family, tuple) else random_model(family)
    engine = MosaicEngine(model, {"progress": False, **(opts or {})})
    gen = engine.generate(**batch_inputs(family, model, batch), **case)
    lw = model.layers[0]
    return gen.tokens, sum(t.numel() * t.element_size() for t in lw.values()), max(h.plan_bytes for h in engine.history)


def check_same_tokens(ranks, cases):
    for i, (family, case, batch, *opts) in enumerate(cases):
        tokens, layer_bytes, plan_bytes = one_process(family, case, batch, *opts)
        for r in ranks:
            got = r[i]
            assert "error" not in got, got
            assert got["world"] == 2
            assert torch.equal(got["tokens"], tokens), (family, case)
            # each rank holds half of every layer's matrices (the norms are replicated)
            assert layer_bytes / 2 <= got["layer_bytes"] < 0.51 * layer_bytes + 1024
            # the attention and FFN buffers shrink; a MoE's expert buffers do not (a rank's
            # expert may receive every row), and they set its peak
            assert got["plan_bytes"] < plan_bytes or "moe" in str(family) and got["plan_bytes"] == plan_bytes


# batch 2: the prompts have different lengths, so the first is left-padded
FAST = [("llada", dict(max_new_tokens=12, steps=6), 2),                                   # exact sampler
        ("llada", dict(max_new_tokens=8, steps=4, block_length=4, cache="dual"), 2),      # dual cache
        ("dream", dict(max_new_tokens=10, steps=5, alg="entropy"), 2)]                   # grouped-query heads
SLOW = [("llada", dict(max_new_tokens=8, steps=8, cfg_scale=1.0, remasking="random", seed=1), 1),
        ("llada", dict(max_new_tokens=8, steps=4, block_length=4, cache="prefix", threshold=0.9), 2),
        ("dream", dict(max_new_tokens=10, steps=5, alg="topk_margin", top_k=9, temperature=0.7, seed=2), 2),
        ("dream", dict(max_new_tokens=8, steps=4, block_length=4, cache="dual", alg="entropy"), 1),
        (("illada", {"o_bias": True}), dict(max_new_tokens=8, steps=4), 2),   # o bias added once
        ("llada_moe", dict(max_new_tokens=10, steps=5), 2),
        ("llada", dict(max_new_tokens=8, steps=8, speculate=2), 2),                       # self-speculative
        ("dream", dict(max_new_tokens=8, steps=8, speculate=2, alg="entropy"), 2),
        ("llada", dict(max_new_tokens=8, steps=4), 2, {"batch_invariant": True}),
        ("llada", dict(max_new_tokens=8, steps=4), 1, {"batch_invariant": True})]
# after the FAST cases, in the same processes: an over-budget request, a combination tensor
# parallelism refuses, then a request that fits (the engine serves on after a refusal)
LOGITS = [("dream", "logits", 0, {}), ("llada_moe", "logits", 0, {})]
REFUSED = [("llada", dict(max_new_tokens=4000, steps=1), 1, {"memory_budget": "321MiB"}),
           ("llada", dict(max_new_tokens=8, steps=4), 1, {"offload": "weights"}),
           ("llada", dict(max_new_tokens=8, steps=4), 1, {"memory_budget": "1GiB"})]


@pytest.fixture(scope="module")
def fast_ranks(tmp_path_factory):
    """One pair of processes for the default run's cases (spawning costs most of the time)."""
    return run_cases(tmp_path_factory.mktemp("tp"), [(f, c, b, {}) for f, c, b in FAST] + REFUSED + LOGITS)


def test_two_ranks_give_the_single_process_tokens(fast_ranks):
    check_same_tokens([r[:len(FAST)] for r in fast_ranks], FAST)


@pytest.mark.slow
def test_two_ranks_more_samplers_and_families(tmp_path):
    ranks = run_cases(tmp_path, [(f, c, b, *(o or [{}])) for f, c, b, *o in SLOW])
    check_same_tokens(ranks, SLOW)
    # batch_invariant under tensor parallelism: the first prompt alone = the same prompt batched
    alone, batched = ranks[0][-1]["tokens"], ranks[0][-2]["tokens"]
    assert torch.equal(alone.reshape(-1)[-8:], batched[0, -8:])


def test_refusals_are_the_same_on_every_rank(fast_ranks):
    """An over-budget request is refused on both ranks with one message (the agreed need and the
    shortest longest-that-fits); a combination TP does not support is one clear error."""
    over, offload, fits = ([r[len(FAST) + i] for r in fast_ranks] for i in range(3))
    assert over[0] == over[1] and over[0]["error"].startswith("MemoryBudgetError: request of 1 x")
    assert "per GPU" in over[0]["error"] and "longest that fits on 2 GPUs" in over[0]["error"]
    assert offload[0] == offload[1] and "offload is not available under tensor parallelism" in offload[0]["error"]
    assert torch.equal(fits[0]["tokens"], fits[1]["tokens"])


def test_every_rank_holds_the_same_bits_near_one_process(fast_ranks):
    """The row-parallel sums are gathered and added in rank order, so both ranks' logits are equal
    bit for bit; against one process only the split reductions of o and down move the last bits."""
    for i, (family, *_) in enumerate(LOGITS):
        a, b = (r[len(FAST) + len(REFUSED) + i]["logits"] for r in fast_ranks)
        assert torch.equal(a, b)
        one = full_logits(random_model(family))
        err = float((a - one).norm() / one.norm())
        assert err < 1e-6, (family, err)      # measured 2.6e-7 (dream), 1.9e-7 (llada_moe)
