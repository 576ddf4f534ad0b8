"""The budget's charges: rounding bounds, the CPU/GPU split, the measured workspace, the warm-up's
measurement logic, the engine's guard wiring, and `mosaic plan` = run-time admission (CPU)."""


import pytest
import torch
from conftest import random_model
from hypothesis import given
from hypothesis import strategies as st

from mosaic import MosaicEngine, load
from mosaic.engine.warmup import warm_up
from mosaic.errors import MemoryBudgetError
from mosaic.memory.accounting import (
    FIXED_BYTES,
    H200_CONTEXT_BYTES,
    H200_WORKSPACE_BYTES,
    LATE_LOAD_BYTES,
    REQUEST_SLACK_BYTES,
    STEP_ROUNDING_BYTES,
    Budget,
    arena_bytes,
    input_bytes,
)
from mosaic.memory.caching import MiB, pool_bytes
from mosaic.memory.transient import SMALL_POOL_BYTES, DeviceGuard, SimBackend
from mosaic.policy.admission import fit
from mosaic.policy.capacity import capacity_report, templates_for
from mosaic.policy.chunking import LazyChunker
from mosaic.policy.prepare import Preparer
from mosaic.policy.probe import probe_step

GiB = 2**30


@given(plan=st.integers(0, 80 * GiB), ext=st.integers(0, 4 * GiB))
def test_step_rounding_bounds_what_the_arena_and_the_pool_take(plan, ext):
    taken = arena_bytes(plan) + (pool_bytes(ext) + SMALL_POOL_BYTES if ext else 0)
    assert plan + ext <= taken <= plan + ext + STEP_ROUNDING_BYTES


def test_cuda_budget_charges_rounding_and_late_loads_a_cpu_budget_does_not():
    gpu = Budget.build(40 * GiB, 16 * GiB, H200_CONTEXT_BYTES, 100 * MiB, cuda=True)
    cpu = Budget.build(40 * GiB, 16 * GiB, 0, FIXED_BYTES, cuda=False)
    assert gpu.fixed_bytes == 16 * GiB + H200_CONTEXT_BYTES + 100 * MiB + LATE_LOAD_BYTES
    assert gpu.rounding_bytes == REQUEST_SLACK_BYTES + STEP_ROUNDING_BYTES
    assert cpu.fixed_bytes == 16 * GiB + FIXED_BYTES and cpu.rounding_bytes == 0
    for b in (gpu, cpu):   # what fits the limit totals the budget exactly
        assert b.total(b.activation_limit(1, 1000), 1, 1000) == 40 * GiB
    assert Budget.h200(40 * GiB, 16 * GiB).workspace_bytes == H200_WORKSPACE_BYTES


def test_a_measured_workspace_replaces_the_guess():
    b = Budget.build(20 * GiB, 16 * GiB, 600 * MiB, FIXED_BYTES).with_workspace(90 * MiB)
    assert b.workspace_bytes == 90 * MiB
    assert b.fixed_bytes == 16 * GiB + 600 * MiB + 90 * MiB + LATE_LOAD_BYTES
    row = b.breakdown(10 * GiB, 130 * MiB, 1, 180224)
    assert row["predicted_bytes"] == b.total(10 * GiB + 130 * MiB, 1, 180224)
    assert row["input_bytes"] == input_bytes(1, 180224)


@pytest.mark.parametrize("name, budget", [("dream-7b", "40GiB"), ("llada-8b", "20GiB")])
def test_plan_and_run_time_admission_agree_to_the_token(name, budget):
    """`mosaic plan`'s L_max fits run-time admission's check (same Budget, same
    prepare) and L_max + 1024 does not, for a GPU-recorded template on this CPU."""
    model = load(name, device="meta")
    rep = capacity_report(model, budget)
    bud = Budget.h200(rep["budget_bytes"], model.weight_bytes())
    tc = templates_for(model)
    prep = Preparer(tc, LazyChunker(lambda s: bud.activation_limit(s.batch, s.length)))
    n = rep["l_max"]
    for ratio in (1.0, 0.1):
        fit(prep, bud, probe_step(model, n, max(1, round(0.5 * n * ratio))))
    with pytest.raises(MemoryBudgetError):
        m = n + 1024
        for ratio in (1.0, 0.1):
            fit(prep, bud, probe_step(model, m, max(1, round(0.5 * m * ratio))))
    assert rep["workspace_bytes"] == H200_WORKSPACE_BYTES
    assert rep["rounding_bytes"] == bud.rounding_bytes


class FakeCounters:
    """A device whose counter grows by what the warm-up's requests leave behind."""

    def __init__(self, arena=None, weights=0):
        # the driver holds the context (0 on a CPU budget), PyTorch the weights
        self.driver, self.torch, self.touched, self.arena = 0, weights, False, arena

    def used(self):
        return self.driver + self.reserved()

    def reserved(self):   # a host arena is a PyTorch tensor: the warm-up must not count it
        return self.torch + (self.arena.mapped_bytes if self.arena is not None else 0)

    def settle(self):
        pass

    def touch(self, dtype):
        self.touched = True
        self.torch += 32 * MiB          # cuBLAS workspace, PyTorch's
        self.driver += 4 * MiB          # handles


def test_warm_up_measures_the_workspace_and_halves_a_refused_length():
    eng = MosaicEngine(random_model("llada"), {"progress": False})
    c = FakeCounters(eng.arena, eng.model.weight_bytes())
    calls = []
    def run_request(prompt, gen_len, opts):
        n = len(prompt) + gen_len
        calls.append((n, dict(opts, steps=1)))
        if n > 1024:
            raise MemoryBudgetError("too long", needed_bytes=1, budget_bytes=0)
        c.driver += 2 * MiB             # a kernel module loaded
        return eng.warm_request(prompt, gen_len, opts)
    rep = warm_up(eng.memory, run_request, eng.sampler, length=4096, counters=c)
    assert c.touched and [n for n, _ in calls[:3]] == [4096, 2048, 1024]
    assert rep["workspace_bytes"] == 36 * MiB + 2 * MiB * len(rep["ran"])
    assert rep["workspace_torch_bytes"] == 32 * MiB
    assert {"cfg_scale": 1.0} in [{k: v for k, v in r.items() if k != "tokens"} for r in rep["ran"]]
    assert all(kw["block_length"] == n // 2 for n, kw in calls)   # LLaDA: one block, one step
    assert len(rep["skipped"]) == 2 and getattr(eng, "last_admission", None) is None


def test_dream_warm_up_cases_use_only_dream_options():
    eng = MosaicEngine(random_model("dream"), {"progress": False})
    rep = warm_up(eng.memory, eng.warm_request, eng.sampler, length=256,
                  counters=FakeCounters(weights=eng.model.weight_bytes()))
    algs = {r.get("alg") for r in rep["ran"]}
    assert {"origin", "maskgit_plus", "topk_margin", "entropy"} <= algs and not rep["skipped"]


def test_engine_runs_every_planned_step_under_the_guard_and_lifts_the_cap_after():
    eng = MosaicEngine(random_model("llada"), {"progress": False, "memory_budget": "1GiB"})
    backend = SimBackend()
    eng.memory.use_guard(DeviceGuard(backend, eng.budget.budget_bytes, outside_bytes=0))
    seen = []

    def scope():
        seen.append(backend.limit)
        return eng.guard.scope()
    eng.runner.scope = scope
    eng.generate([1, 2, 3], max_new_tokens=8, steps=4)
    assert eng.guard.steps == 4 and len(seen) == 4 and all(x == eng.budget.budget_bytes for x in seen)
    assert backend.limit is None                       # lifted after the request
    assert eng.memory_report()["workspace_bytes"] == FIXED_BYTES
    with pytest.raises(MemoryBudgetError):            # refused before the guard is touched
        eng.generate(list(range(30)) * 10**5, max_new_tokens=8, steps=1)
    assert eng.guard.steps == 4 and backend.limit is None
    assert torch.equal(eng.generate([1, 2, 3], max_new_tokens=8, steps=4).tokens,
                       MosaicEngine(eng.model, {"progress": False}).generate([1, 2, 3], max_new_tokens=8,
                                                                              steps=4).tokens)
