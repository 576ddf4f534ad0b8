"""Lazy chunking: exact at every chunk combination, minimal, and the plan is the arena's peak."""

import itertools

import pytest
import torch
from conftest import bundled, random_model

from mosaic import MemoryBudgetError, MosaicEngine, load
from mosaic.policy.capacity import capacity_report, templates_for
from mosaic.policy.chunking import choose, phase_peak
from mosaic.policy.probe import probe_step


def one_step(engine, prompt):
    """(x0, confidence) of the first denoising step on the planned path."""
    x = engine.canvas(engine.encode(prompt), 8).ids
    return engine.step(x)


@pytest.mark.slow
def test_every_chunk_combination_is_exact():
    """Each phase split 1..8 ways (512 combinations): the same candidates and confidences."""
    model = load(bundled("tiny-llada"))
    prompt = "sort 31415926="
    ref_x0, ref_conf = one_step(MosaicEngine(model, {"progress": False}), prompt)
    for a, f, lg in itertools.product(range(1, 9), repeat=3):
        engine = MosaicEngine(model, {"progress": False, "chunks": (a, f, lg)})
        x0, conf = one_step(engine, prompt)
        assert torch.equal(x0, ref_x0) and torch.equal(conf, ref_conf), (a, f, lg)


@pytest.mark.parametrize("family", ["llada", "dream", "llada_moe"])
def test_predicted_peak_is_the_arena_high_water_mark(family):
    model = random_model(family)
    engine = MosaicEngine(model, {"progress": False, "chunks": (3, 2, 2)})
    kw = {"alg": "entropy"} if family == "dream" else {}
    engine.generate([5, 6, 7, 8, 9, 10, 11], max_new_tokens=9, steps=3, **kw)
    planned = max(h.plan_bytes for h in engine.history)
    assert engine.arena.peak_bytes == planned


def test_search_finds_the_smallest_counts_that_fit():
    model = load("llada-8b", device="meta")
    runner = templates_for(model)
    step = probe_step(model, 131072, 65536)
    limit = 6 * 2**30
    chunks = choose(runner, step, limit, 4096)
    for phase, c in zip(("attn", "ffn", "logits"), chunks.as_tuple(), strict=True):
        assert phase_peak(runner, step, phase, c) <= limit
        if c > 1 and not (phase == "attn" and c == 8):  # 8 = the 16k-row floor at N = 128k
            assert phase_peak(runner, step, phase, c - 1) > limit


def test_capacity_report_meets_the_floor_and_names_fields():
    rep = capacity_report(load("llada-8b", device="meta"), "40GiB")
    assert {"model", "budget_bytes", "l_max", "physical_limit", "limiting_phase"} <= set(rep)
    assert 0.99 * rep["physical_limit"] <= rep["l_max"] <= rep["physical_limit"]


def test_budget_refuses_up_front_with_the_longest_that_fits():
    model = random_model("llada")
    fixed = model.weight_bytes() + 320 * 2**20
    engine = MosaicEngine(model, {"progress": False, "memory_budget": fixed + 2 * 2**20})
    with pytest.raises(MemoryBudgetError, match="longest that fits") as err:
        engine.generate(list(range(30)) * 300, max_new_tokens=64, steps=1)
    assert 0 < err.value.max_tokens < 9000 + 64
    assert engine.arena.mapped_bytes == 0          # nothing was allocated for it
    assert engine.generate([1, 2, 3], max_new_tokens=4, steps=2).tokens.shape == (1, 4)


def test_fixed_chunks_are_checked_against_the_budget():
    model = random_model("llada")
    fixed = model.weight_bytes() + 320 * 2**20
    engine = MosaicEngine(model, {"progress": False, "memory_budget": fixed + 64 * 2**10,
                                  "chunks": (1, 1, 1)})
    with pytest.raises(MemoryBudgetError, match="longest that fits"):
        engine.generate(list(range(30)) * 10, max_new_tokens=64, steps=1)
