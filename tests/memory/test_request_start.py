"""The second GPU soak (bench/results/gpu/soak_ad698b3.json): 12 of 402 requests over the
budget by the driver's counter, up to 3.69 GB. The failure modes, reproduced on the CPU with a
simulated device (PyTorch's caching allocator: caching.SimAllocator; the arena: the real VmmArena
on a fake driver; the driver's counter: PyTorch's reserved + the arena's pages + what the
driver holds), and the request protocol the engine follows (device_memory.guard_begin at a request's
start, device_memory.guard_step before each step, then the arena's growth, then the step's ops)."""

import types

import pytest
import torch
from conftest import random_model

from mosaic import MemoryBudgetError, MosaicEngine
from mosaic.engine import device_memory as engine_mod
from mosaic.engine import warmup
from mosaic.memory import transient
from mosaic.memory.accounting import arena_bytes
from mosaic.memory.caching import pool_bytes
from mosaic.memory.transient import SMALL_POOL_BYTES, DeviceGuard, SimBackend
from mosaic.memory.vmm import MiB, VmmArena

GRAN = 2 * MiB


class _Driver:
    """The arena's pages, counted by the simulated device at every map."""

    def __init__(self, device):
        self.dev, self.mapped, self.n = device, {}, 0

    def granularity(self):
        return GRAN

    def total_bytes(self):
        return 1 << 40

    def reserve(self, n):
        return 1 << 40

    def free(self, va, n):
        pass

    def create(self, n):
        self.n += 1
        return self.n

    def map(self, va, n, h):
        self.mapped[va] = n
        self.dev.sample()

    def unmap(self, va, n):
        assert self.mapped.pop(va) == n

    def release(self, h):
        pass

    def record_event(self):
        return None

    def event_done(self, ev):
        return True

    def wait(self, ev):
        pass


class _Backend(SimBackend):
    """PyTorch's allocator, counted by the simulated device after every new segment."""

    def __init__(self, device):
        super().__init__()
        self.dev = device

    def malloc(self, nbytes):
        h = super().malloc(nbytes)
        self.dev.sample()
        return h

    def reserve(self, pool, large, small):
        super().reserve(pool, large, small)
        self.dev.sample()


class Device:
    """outside: what the driver holds (context, handles); used() is the driver's counter."""

    def __init__(self, outside):
        self.outside, self.peak = outside, 0
        self.backend = _Backend(self)
        self.arena = VmmArena(torch.device("cpu"), driver=_Driver(self), exact=True)

    def used(self):
        return self.backend.reserved() + self.arena.physical_bytes + self.outside

    def sample(self):
        self.peak = max(self.peak, self.used())


def run_request(dev, guard, input_bytes, steps):
    """One request as MosaicEngine.generate runs it: admission (the first step), the request's
    tensors, then per step: before_step, the arena's growth, the step's transients in scope."""
    first = types.SimpleNamespace(plan_bytes=steps[0][0], external_bytes=steps[0][1])
    begin = getattr(engine_mod, "guard_begin", None)
    if begin is not None:
        begin(guard, dev.arena, first)
    canvas = dev.backend.malloc(input_bytes)
    for plan, ext in steps:
        prepared = types.SimpleNamespace(plan_bytes=plan, external_bytes=ext)
        engine_mod.guard_step(guard, dev.arena, prepared)
        dev.arena.ensure(plan)
        dev.sample()
        with guard.scope():
            if ext:
                dev.backend.free(dev.backend.malloc(ext))
    dev.backend.free(canvas)
    guard.end()


def charged(weights, outside, input_bytes, plan, ext):
    """What admission charges for a step (accounting.Budget.total with the CUDA rounding)."""
    return weights + outside + input_bytes + 20 * MiB + arena_bytes(plan) + \
        (pool_bytes(ext) + SMALL_POOL_BYTES if ext else 0)


def test_a_large_pool_is_not_reserved_next_to_the_previous_plans_pages():
    """Rows 147 / 220 of the soak: a request with a small plan and a large out-of-plan pool right
    after one with a large plan. The pool was reserved (under a cap that assumed the new, small
    plan) while the old plan's pages were still mapped: 50.15 GB at a 48 GiB budget."""
    outside, weights = 500 * MiB, 2000 * MiB
    budget = 5500 * MiB
    dev = Device(outside)
    w = dev.backend.malloc(weights)
    guard = DeviceGuard(dev.backend, budget, outside)
    big_plan = (8 * MiB, [(2800 * MiB, 100 * MiB)])
    big_pool = (8 * MiB, [(400 * MiB, 2500 * MiB)])
    for inp, steps in (big_plan, big_pool, big_plan):
        assert charged(weights, outside, inp, *steps[0]) <= budget     # both are admitted
        run_request(dev, guard, inp, steps)
    assert dev.peak <= budget, f"over the budget by {(dev.peak - budget) / MiB:.0f} MiB"
    dev.backend.free(w)


def test_a_request_starting_with_the_previous_requests_cached_blocks_stays_in_budget():
    """The previous request's tensors are freed but still reserved by the caching allocator and
    its plan's pages still mapped when the next request allocates its own tensors (before its
    first step): those must come from under a cap, after the cache and the pages are released."""
    outside, weights = 500 * MiB, 2000 * MiB
    budget = 5500 * MiB
    dev = Device(outside)
    w = dev.backend.malloc(weights)
    guard = DeviceGuard(dev.backend, budget, outside)
    first = (300 * MiB, [(2560 * MiB, 100 * MiB)] * 2)
    second = (400 * MiB, [(2400 * MiB, 100 * MiB)])
    for inp, steps in (first, second, first):
        assert charged(weights, outside, inp, *steps[0]) <= budget
        run_request(dev, guard, inp, steps)
    assert dev.peak <= budget, f"over the budget by {(dev.peak - budget) / MiB:.0f} MiB"
    dev.backend.free(w)


def test_random_request_streams_never_pass_the_budget_by_the_devices_counter():
    import random
    rng = random.Random(1)
    outside, weights = 700 * MiB, 3000 * MiB
    budget = 9000 * MiB
    dev = Device(outside)
    w = dev.backend.malloc(weights)
    guard = DeviceGuard(dev.backend, budget, outside)
    for _ in range(60):
        inp = rng.choice([1 * MiB, 6 * MiB, 40 * MiB, 300 * MiB])
        ext = rng.choice([0, 3 * MiB, 40 * MiB, 900 * MiB, 3000 * MiB])
        room = budget - charged(weights, outside, inp, 0, ext)
        steps = []
        for k in range(rng.randint(1, 3)):     # later steps of a request never need more
            plan = int(room * rng.uniform(0.1, 1.0)) // GRAN * GRAN if k == 0 else \
                steps[0][0] // (k + 1) // GRAN * GRAN
            steps.append((plan, ext if k == 0 else rng.choice([0, ext])))
        run_request(dev, guard, inp, steps)
    assert dev.peak <= budget, f"over the budget by {(dev.peak - budget) / MiB:.0f} MiB"
    dev.backend.free(w)


def test_the_engine_allocates_a_requests_tensors_under_the_cap():
    """The canvas is made after admission: the cap must already hold then (it was lifted after
    the previous request), and the previous request's cached blocks must be handed back."""
    eng = MosaicEngine(random_model("llada"), {"progress": False, "memory_budget": "1GiB"})
    backend = SimBackend()
    eng.memory.use_guard(DeviceGuard(backend, eng.budget.budget_bytes, outside_bytes=0))
    stale = backend.malloc(64 * MiB)
    backend.free(stale)                                   # a cached block of an earlier request
    seen = []
    real = eng.requests.canvas

    def canvas(*a, **k):
        seen.append((backend.limit, backend.default.reserved))
        return real(*a, **k)
    eng.requests.canvas = canvas
    eng.generate([1, 2, 3], max_new_tokens=8, steps=2)
    assert seen == [(eng.budget.budget_bytes, 0)]
    assert backend.limit is None and eng.guard.last_limit_bytes == eng.budget.budget_bytes


def test_live_tensors_the_budget_does_not_cover_refuse_the_request_before_its_tensors():
    eng = MosaicEngine(random_model("llada"), {"progress": False, "memory_budget": "1GiB"})
    backend = SimBackend()
    eng.memory.use_guard(DeviceGuard(backend, eng.budget.budget_bytes, outside_bytes=0))
    keep = backend.malloc(eng.budget.budget_bytes - 4 * MiB)   # the caller's own tensors
    made = []
    eng.requests.canvas = lambda *a, **k: made.append(1)
    with pytest.raises(MemoryBudgetError, match="accounting missed"):
        eng.generate([1, 2, 3], max_new_tokens=8, steps=2)
    assert backend.limit is None and not made             # lifted again, nothing made
    backend.free(keep)


def test_a_depth_truncated_model_charged_full_weights_caps_pytorch_at_what_it_holds():
    """The soak's models hold one layer and are charged all of them (Model.charged_layers): the
    cap must leave PyTorch only the budget less the layers it does not hold, or it never binds
    (the soak's cap was ~12 GiB above what admission charged PyTorch)."""
    model = random_model("llada", num_layers=1)
    per_layer = sum(t.numel() * t.element_size() for t in model.layers[0].values())
    model.charged_layers = 11
    eng = MosaicEngine(model, {"progress": False, "memory_budget": "1GiB"})
    assert warmup.phantom_weight_bytes(model) == 10 * per_layer
    rep = {"workspace_bytes": 48 * MiB, "workspace_torch_bytes": 32 * MiB, "workspace_driver_bytes": 16 * MiB}
    guard = warmup.make_guard(eng.model, eng.budget, rep, SimBackend())
    b = eng.budget
    assert guard.outside_bytes == b.context_bytes + 16 * MiB + b.late_bytes + 10 * per_layer
    assert guard.torch_limit(0) == b.budget_bytes - guard.outside_bytes


class _Counters:
    """A process on its second engine: the BLAS handles and workspaces exist before warm-up."""

    def __init__(self, weights, context, arena):
        self.torch, self.driver, self.arena = weights + 32 * MiB, context + 80 * MiB, arena

    def used(self):
        return self.driver + self.reserved()

    def reserved(self):   # the CPU's arena is a PyTorch tensor
        return self.torch + self.arena.mapped_bytes

    def settle(self):
        pass

    def touch(self, dtype):
        pass


def test_a_second_engines_warm_up_charges_the_workspace_that_already_exists():
    """The soak's engines after the first measured workspace 0: cuBLAS's workspaces (32 MiB in
    PyTorch's pool) were made by the first engine, so a before/after difference sees nothing."""
    eng = MosaicEngine(random_model("llada"), {"progress": False, "memory_budget": "1GiB"})
    ctx = 600 * MiB
    eng.memory.budget = eng.budget.__class__.build(eng.budget.budget_bytes, eng.budget.weights_bytes, ctx,
                                            eng.budget.workspace_bytes, cuda=True)
    c = _Counters(warmup.resident_weight_bytes(eng.model), ctx, eng.arena)
    rep = warmup.warm_up(eng.memory, eng.warm_request, eng.sampler, length=256, counters=c)
    assert rep["workspace_torch_bytes"] == 32 * MiB
    assert rep["workspace_driver_bytes"] == 80 * MiB
    assert rep["workspace_bytes"] == 112 * MiB


@pytest.mark.parametrize("nbytes", [0, 1, 17 * MiB + 3, 2**37 - 1, 141 * 2**30])
@pytest.mark.parametrize("totals", [(150_150_000_000, 150_150_000_000), (150_150_000_000, 150_000_000_000)])
def test_the_fraction_never_lets_pytorch_past_the_bytes_asked(nbytes, totals):
    """torch >= 2.5 caps at fraction x totalGlobalMem, older ones at fraction x cudaMemGetInfo's
    total; whichever total the installed torch multiplies by, the cap stays at most nbytes."""
    frac = transient.fraction_for(nbytes, *totals)
    assert 0.0 <= frac <= 1.0
    for t in totals:
        assert int(frac * t) <= nbytes
