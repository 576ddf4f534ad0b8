"""The engine's device memory: budgets per offload mode, the arena, the paged K/V pool, where the
weights live, the warm-up and the budget guard, and the hooks the planned runner calls around each
step (docs/MEMORY.md, docs/OFFLOAD.md).

Two budget views share one measured context and workspace: `budget` charges every weight,
`offload_budget` only the weights outside the layers (the layers live in pinned host memory and
stream through staging slots that the plan holds). The budget is the process's: at start the
context charged is what the process holds on the device outside this engine's weights (the CUDA
context, library handles, and whatever other live engines or tensors of the process hold), so a
second engine in one process admits against what is left.

The budget guard (memory/transient.py) caps PyTorch at budget - what the driver holds - the
arena's pages. That sum holds in every mode: offloaded layers are host memory, outside the
device's counter. A depth-truncated bench model's phantom layers (charged, not held) count
against the cap only in resident mode, where admission charges them too.

Captured steps under a budget (runtime/graphs.py, policy/graph_charge.py): a request admitted
with its graphs puts the guard in graph mode for its run (the transient pool is the graphs',
kept across steps and requests, every planned step on the graphs' stream, the executables'
charge outside PyTorch) and holds the graphs under what admission charged them (several requests
in flight: their stacked step's charge, set by the Scheduler); one admitted without them drops
every graph and runs eager. Between requests and outside one (engine.step) nothing is captured."""

from __future__ import annotations

import resource
import threading
import weakref
from contextlib import nullcontext
from pathlib import Path

import torch

from ..config import EngineConfig
from ..errors import MemoryBudgetError, gib
from ..graph.shard import world
from ..graph.streams import CopyEngine, HostPool
from ..loader import host_available_bytes, planned_weight_bytes, resolve_device, resolve_dtype
from ..memory.accounting import FIXED_BYTES, Budget, arena_bytes, card_bytes, context_bytes, refuse_below_fixed
from ..memory.arena import make_arena
from ..memory.capture_guard import device_wide
from ..policy.admission import Admission, resident_bytes
from ..policy.offload import candidates, offload_of
from ..runtime import parallel
from ..runtime.placement import WeightPlacement
from . import warmup
from .steps import kv_pool_for


class DeviceMemory:
    """Budgets, arena, K/V pool, weight placement, guard and the runner's hooks of one engine. Raises
    MemoryBudgetError at construction for a budget below what the model holds before any token,
    and InputError for a budget above the card."""

    def __init__(self, model, config: EngineConfig):
        self.model, self.config = model, config
        dev = self.device = model.device
        if world()[1] > 1:  # NCCL's buffers exist before it is measured; every rank charges the largest
            context, others = parallel.startup_context(dev, model.tensor is not None), 0
        else:
            context, others = context_bytes(dev), _others_bytes(model)
        self.context_driver_bytes, self.others_bytes = context, others
        self.budget = Budget.of(config.memory_budget, dev, model.weight_bytes(), context + others)
        # layers in host memory: only the embedding, LM head and norms stay charged
        self.offload_budget = Budget.of(config.memory_budget, dev, model.weight_bytes(layers=False),
                                        context + others)
        self._check_budget()
        self.placement = WeightPlacement(model, dev)
        self.arena = make_arena(dev, config.arena)
        self.copier = CopyEngine(dev)                       # streamed steps: one side stream, one host pool
        self.host_pool = HostPool(pin=dev.type == "cuda")
        self.guard, self.graphs = None, None     # graphs: the engine's runtime.graphs.StepGraphs (attach_graphs)
        self.captured = False  # captured: the requests running now may capture their steps
        self.kv_pool = kv_pool_for(model, self.has_budget)   # the paged K/V pool's buffers (memory/kv_pool.py)
        self._slack_base: int | None = None  # its activation limit less its graphs' charge
        self.owners: set[int] = set()        # id()s of the requests in flight (begin .. end): in_request
        self.warmup_report: dict | None = None
        self._guard_phantom = 0
        self._threads = {threading.get_ident()}   # threads whose libraries are made (enter_thread)
        self.closed = False
        _LIVE.add(self)

    def _check_budget(self) -> None:
        last = self.budget_for(offload_of(candidates(self.config)[-1], self.config, self.model.cfg))
        refuse_below_fixed(last, self.model.name, self.others_bytes)
        card = card_bytes(self.device)
        if card is not None and self.budget.budget_bytes is not None and self.budget.budget_bytes > card:
            raise MemoryBudgetError(f"memory budget {gib(self.budget.budget_bytes)} is more than this GPU has "
                                    f"({gib(card)}): give at most {gib(card)} (or a fraction 0 < f <= 1 of the card)",
                                    needed_bytes=self.budget.budget_bytes, budget_bytes=card)

    @property
    def in_request(self) -> bool:     # a request is in flight (between its begin and its end)
        return bool(self.owners)

    @property
    def has_budget(self) -> bool:
        return self.budget.budget_bytes is not None

    def budget_for(self, offload) -> Budget:
        """The budget view of a mode: resident weights charged, or only the non-layer weights."""
        return self.budget if offload is None else self.offload_budget

    def activation_limit(self, step) -> int | None:
        """Bytes a step's plan may use: its mode's budget less a block cache's persistent K/V."""
        free = self.budget_for(step.offload).activation_limit(step.batch, step.length, step.shard_slots)
        return None if free is None else free - resident_bytes(step)

    # -- the warm-up (mosaic/engine/warmup.py)
    def warm_up(self, run_request, sampler) -> dict:
        """Measure the workspace a step leaves on the device (run_request(ids, gen_len, options)
        runs one planned request), charge it instead of the FIXED_BYTES guess, and from then on
        run every planned step under the device guard: out-of-plan transients from a
        pre-reserved pool, PyTorch capped at the budget's rest."""
        self.warmup_report = rep = warmup.warm_up(self, run_request, sampler, graphs=self.graphs)
        self.budget = self.budget.with_workspace(rep["workspace_bytes"])
        self.offload_budget = self.offload_budget.with_workspace(rep["workspace_bytes"])
        stream = getattr(self.graphs.backend, "stream", None) if self.graphs is not None else None
        self.use_guard(warmup.make_guard(self.model, self.budget, rep, stream=stream, pool=self.config.transient_pool))
        self._guard_phantom = warmup.phantom_weight_bytes(self.model)   # in the guard's outside_bytes
        return rep

    def enter_thread(self) -> None:
        """Before a thread's first request (a server's engine thread): its cuBLAS handle and
        workspaces made now, outside every pool, and charged as workspace from then on
        (warmup.touch_thread). Call with no request running (no cap in force); once per thread."""
        me = threading.get_ident()
        if self.device.type != "cuda" or me in self._threads:
            return
        self._threads.add(me)
        stream = getattr(self.graphs.backend, "stream", None) if self.graphs is not None else None
        torch_bytes, driver_bytes = warmup.touch_thread(self.device, self.model.dtype, [stream] if stream else [])
        if self.has_budget and torch_bytes + driver_bytes:
            ws = self.budget.workspace_bytes + torch_bytes + driver_bytes
            self.budget = self.budget.with_workspace(ws)
            self.offload_budget = self.offload_budget.with_workspace(ws)
            if self.guard is not None:
                self.guard.add_outside(driver_bytes)

    # -- the runner's hooks (runtime/runner.PlannedRunner)
    def use_guard(self, guard) -> None:
        """Run every planned step under `guard` from now on (the warm-up's; tests give one with a
        simulated allocator): the arena maps exactly each plan's pages."""
        self.guard = guard
        self.arena.exact = True
        self._wire()

    def attach_graphs(self, graphs) -> None:
        """The engine's captured steps (runtime/graphs.StepGraphs): they capture only while
        graphs_allowed(), into graph_pool() under a guard."""
        self.graphs = graphs
        if graphs is not None:
            graphs.bind(self.graphs_allowed, self.graph_pool, self.capture_failed)
        self._wire()

    def capture_failed(self) -> None:
        """A capture failed: the guard's pool it recorded into is dropped (its graphs with it)
        and the next step reserves a new one, so that no later capture or step meets the
        allocator still recording into it ("beginAllocateToPool: already recording")."""
        if self.guard is not None:
            self.guard.drop_pool()

    def _wire(self) -> None:
        if self.graphs is not None and self.guard is not None:
            self.guard.host_graphs(self.graphs.drop_graphs)   # graphs go before the pool they replay from

    def graphs_allowed(self) -> bool:
        """Whether a step may be captured now: inside a request, when it was admitted with its
        graphs (under a guard: in graph mode); outside one (engine.step), only without a guard."""
        if self.in_request:
            return self.captured and (self.guard is None or self.guard.keep)
        return self.guard is None

    def graph_pool(self):
        """(pool id, stream) captures allocate from: the guard's pool in graph mode, else None."""
        return self.guard.graph_pool() if self.guard is not None else None

    def stream(self):
        """The context a planned step runs in, eager or replayed: graph mode's stream."""
        return self.guard.stream() if self.guard is not None else nullcontext()

    def before_step(self, prepared) -> None:
        """Under the guard: the arena cut down to the step's plan, then the transient pool and
        PyTorch's cap for it (the arena grows after, in the runner). In graph mode a kept pool
        may exceed the step's charge by what the step leaves unused of its request's allowance."""
        if self.guard is not None:
            slack = 0 if self._slack_base is None else max(0, self._slack_base - prepared.need_bytes)
            guard_step(self.guard, self.arena, prepared, slack)

    def scope(self):
        """The context a step's ops run in: the guard's transient pool (else nothing)."""
        return self.guard.scope() if self.guard is not None else nullcontext()

    def after_step(self, prepared) -> None:
        """Without the guard but under a budget: hand PyTorch's cached blocks back when they
        exceed what the plan expects outside the arena (the caching allocator keeps freed blocks
        reserved). The guard caps PyTorch itself."""
        if self.guard is not None or self.device.type != "cuda" or not self.has_budget:
            return
        allowance = prepared.external_bytes + FIXED_BYTES + resident_bytes(prepared.step) + \
            (prepared.plan_bytes if self.arena.kind == "host" else 0)
        if torch.cuda.memory_reserved(self.device) > allowance:
            torch.cuda.empty_cache()

    # -- a request's start and end
    def begin(self, admission: Admission | None, held: int = 0, owner: object = None) -> None:
        """After admission, before the request's first tensor: the layers where its mode reads them (moved
        while no cap is set), then the arena cut to its plan, the cache of earlier requests handed back, PyTorch
        capped (memory/transient.py). held: bytes kept beyond its charge (idle K/V pool buffers: engine/run.py);
        owner: its run (one joining others in flight leaves the guard and graphs to the batch: batch_graphs)."""
        self.enter_thread()
        self.place(admission.offload if admission is not None else None)
        joins = self.in_request
        self.owners.add(id(owner))
        if joins:
            return
        self.captured = admission is not None and admission.captured
        if self.guard is not None and admission is not None:
            self._graph_mode(admission.graphs if admission.captured else None,
                             self.activation_limit(admission.prepared.step), held)
            slack = 0 if self._slack_base is None else max(0, self._slack_base - admission.prepared.need_bytes)
            guard_begin(self.guard, self.arena, admission.prepared, slack)

    def batch_graphs(self, charge, spare: int | None) -> None:
        """A running batch's graphs (engine/scheduler.py): held under `charge` (policy/graph_charge.GraphCharge
        of its stacked step: Admitter.batch_graphs) with `spare` activation bytes before it, or dropped."""
        if self.in_request and self.guard is not None:
            self._graph_mode(charge, spare)

    def _graph_mode(self, charge, limit: int | None, held: int = 0) -> None:
        """Graphs held under `charge` (graph mode) or dropped; limit less charge and held: the kept pool's slack."""
        pools = getattr(self.guard.backend, "strategy", "mempool") == "mempool"   # graphs need a MemPool
        self.captured = on = self.graphs is not None and charge is not None and charge.captured and pools
        if on:
            self.graphs.set_limits(charge.driver_bytes, charge.inputs_bytes)
        elif self.graphs is not None:
            self.graphs.drop_graphs()
        self.guard.use_graphs(on, charge.driver_bytes if on else 0)
        self._slack_base = None if limit is None or not on else limit - charge.total_bytes - held

    def end(self, owner: object = None) -> None:
        """After a request (owner: begin's): the cap lifted and graphs off once none is in flight."""
        self.owners.discard(id(owner))
        if self.owners:
            return
        self.captured, self._slack_base = False, None
        if self.guard is not None:
            self.guard.end()

    def place(self, offload) -> None:
        """The layers where a step of this mode reads them (runtime/placement.py), and the
        guard's view of them: a depth-truncated bench model's phantom layers are charged (and
        capped) only while resident, as admission charges them."""
        self.placement.ensure(offload is not None)
        if self.guard is not None:
            phantom = warmup.phantom_weight_bytes(self.model) if offload is None else 0
            self.guard.add_outside(phantom - self._guard_phantom)
            self._guard_phantom = phantom

    def check_host(self, admission: Admission) -> None:
        """Streamed K/V needs its host buffers (pinned) next to the offloaded layers: refuse
        before any work when the host cannot hold them (GPU only; on a CPU the budget is host)."""
        host = admission.prepared.template.host_bytes
        if not host or self.device.type != "cuda":
            return
        have = host_available_bytes()
        held = self.host_pool.nbytes + self.placement.host_bytes
        need = host + (0 if self.placement.offloaded else sum(self.model.layer_bytes()))
        if have is not None and need > have + held:
            raise MemoryBudgetError(f"streaming K/V from host memory needs {gib(need)} of host memory "
                                    f"(K and V of one sequence, and the offloaded layers); "
                                    f"{gib(have + held)} is available", needed_bytes=need, budget_bytes=have + held)

    # -- reports and release
    def peak_device_bytes(self) -> int:
        """PyTorch's peak reserved + the arena's mapped peak (GPU); the process RSS peak (CPU)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_reserved(self.device)) + self.arena_extra_bytes()
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def arena_extra_bytes(self, now: bool = False) -> int:
        """Arena bytes PyTorch's allocator does not count (the virtual-memory arena's pages)."""
        if self.arena.kind != "vmm":
            return 0
        return self.arena.physical_bytes if now else self.arena.peak_bytes

    def close(self) -> None:
        """Give back the guard's pool and cap, the arena's pages, pinned host buffers and the
        offloaded layers' host copies (the weights go with the model)."""
        with device_wide():       # never while another thread captures (memory/capture_guard.py)
            if self.guard is not None:
                self.guard.close()
            self.arena.close()
            self.host_pool.clear()
            self.closed = True
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


def check_before_load(model_name, config: EngineConfig) -> None:
    """The budget check of DeviceMemory, made before the weights are allocated: the weights'
    bytes from the preset or config.json (loader.planned_weight_bytes; FP8 layers counted at one
    byte per weight, a lower bound), the context measured now and what the other live engines of
    the process hold. A second engine whose weights cannot fit next to the first is refused
    before it takes a byte (it used to build its weights first: 31 GiB on the driver's counter
    under a 24 GiB budget). One process only; nothing to check without a budget."""
    if config.memory_budget is None or world()[1] > 1 or config.parallel == "tensor":
        return
    dev = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, dev)
    sizes = planned_weight_bytes(model_name, dtype, itemsize=1 if config.precision is not None else None)
    if sizes is None:
        return
    everything, outside = sizes
    offloadable = candidates(config)[-1] != "resident"
    others = _held_by_engines(dev)
    budget = Budget.of(config.memory_budget, dev, outside if offloadable else everything,
                       context_bytes(dev) + others)
    refuse_below_fixed(budget, Path(str(model_name)).name or str(model_name), others, before_load=True)


def guard_step(guard, arena, prepared, slack: int = 0) -> None:
    """Before a planned step under a budget: the arena cut down to its plan, then the transient
    pool and PyTorch's cap for it (the arena grows after, in the runner)."""
    guard.before_step(prepared.external_bytes, _outside_pages(arena, prepared), arena, prepared.plan_bytes, slack)


def guard_begin(guard, arena, prepared, slack: int = 0) -> None:
    """At a request's start: the same for its first (admitted) step, with the cache emptied."""
    guard.begin(prepared.external_bytes, _outside_pages(arena, prepared), arena, prepared.plan_bytes, slack)


def _outside_pages(arena, prepared) -> int:
    return arena_bytes(prepared.plan_bytes, arena.gran) if arena.kind == "vmm" else 0


def _others_bytes(model) -> int:
    """What other live engines of this process hold in PyTorch's allocator on the same device:
    their resident weights (each model once: one shared with this engine, or by several other
    engines, is held once), host-kind arenas and K/V pools (kept idle between requests).
    Their virtual-memory arenas are outside PyTorch: the context's driver reading holds them."""
    return _held_by_engines(model.device, model)


def _held_by_engines(device, model=None) -> int:
    """_others_bytes for an engine of `device` whose model is `model` (None: not loaded yet)."""
    if device.type != "cuda":
        return 0
    held, models = 0, set()
    for m in list(_LIVE):
        if m.closed or m.device != device or m.model is model:
            continue
        if id(m.model) not in models:     # engines sharing a model hold its weights once
            models.add(id(m.model))
            held += warmup.resident_weight_bytes(m.model)
        held += (m.arena.mapped_bytes if m.arena.kind == "host" else 0) + warmup.kv_pool_bytes(m)
    return held


# the live DeviceMemory objects of this process (weakly held): a new engine charges what the others
# hold (a second engine admitted against its own count only went 10.6 GiB over the budget)
_LIVE: weakref.WeakSet = weakref.WeakSet()
