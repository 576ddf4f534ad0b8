"""The engine's device memory: budgets per offload mode, admission, the warm-up and budget guard,
and the memory reports (a mixin of engine.MosaicEngine; docs/MEMORY.md, docs/OFFLOAD.md).

Two budget views share one measured context and workspace: `budget` charges every weight,
`offload_budget` only the weights outside the layers (the layers live in pinned host memory and
stream through staging slots that the plan holds). Admission tries the configured modes from the
least streamed on (policy/offload.candidates) and the request runs in the mode admitted; its
prepared step carries the mode (step.offload), so a server's concurrent admission of another
request does not change the mode of the one running.

The budget guard (memory/transient.py) caps PyTorch at budget - what the driver holds - the arena's
pages. That sum holds in every mode: offloaded layers are host memory, outside the device's
counter. A depth-truncated bench model's phantom layers (charged, not held) count against the cap
only in resident mode, where admission charges them too."""

from __future__ import annotations

import functools
import resource

import torch

from . import warmup
from .config import GenerationConfig
from .errors import InputError, MemoryBudgetError, gib
from .graph.shard import world
from .kernels.fp8 import cuda_fp8_error
from .loader import host_available_bytes
from .memory.accounting import FIXED_BYTES, Budget, arena_bytes, context_bytes
from .memory.kv_store import KVStore, StoreLayout
from .models.precision import FP8_NAME, apply_precision, quantize_embedding, ranges
from .policy import timeline
from .policy.admission import Admission, admit, alone, fit, resident_bytes
from .policy.kv_tier import admit_cached, with_store
from .policy.offload import candidates, mode_of, offload_of
from .policy.precision import plan_precision
from .policy.probe import probe_step
from .runtime import parallel


class MemoryMixin:
    """Budgets, admission, the guard and memory reports; the engine sets model, config, budget,
    offload_budget, placement, preparer, runner, arena, guard and lock in its __init__."""

    def _budgets(self, dev) -> None:
        """The budget of each mode, one context measured for both (several processes: NCCL's
        buffers exist before it is measured, and every rank charges the largest of any rank)."""
        cfg, model = self.config, self.model
        context = parallel.startup_context(dev) if world()[1] > 1 else context_bytes(dev)
        self.budget = Budget.of(cfg.memory_budget, dev, model.weight_bytes(), context)
        # layers in host memory: only the embedding, LM head and norms stay charged
        self.offload_budget = Budget.of(cfg.memory_budget, dev, model.weight_bytes(layers=False), context)
        last = self.budget_for(offload_of(candidates(cfg)[-1], cfg, model.cfg))   # the least device share
        if last.budget_bytes is not None and last.budget_bytes <= last.fixed_bytes:
            raise MemoryBudgetError(
                f"memory budget {gib(last.budget_bytes)} is below what {model.name} holds before any token: "
                f"weights {gib(last.weights_bytes)} + context and workspace "
                f"{gib(last.fixed_bytes - last.weights_bytes)} = {gib(last.fixed_bytes)}",
                needed_bytes=last.fixed_bytes, budget_bytes=last.budget_bytes, max_tokens=0)

    def _apply_precision(self, pc) -> dict | None:
        """Per-layer FP8 (config.precision): explicit ranges or chosen by sensitivity."""
        if pc is None:
            return None
        err = cuda_fp8_error(self.model.device)
        if err:
            raise InputError(err)
        rep = plan_precision(self.model, pc)
        apply_precision(self.model, rep["dtypes"])
        if pc.embed == FP8_NAME:
            quantize_embedding(self.model)
        rep["dtypes"] = list(self.model.precision)
        rep["ranges"] = ranges(self.model.precision)
        rep["weight_bytes"] = self.model.weight_bytes()
        return rep

    def budget_for(self, offload) -> Budget:
        """The budget view of a mode: resident weights charged, or only the non-layer weights."""
        return self.budget if offload is None else self.offload_budget

    def _activation_limit(self, step) -> int | None:
        """Bytes a step's plan may use: its mode's budget less a block cache's persistent K/V."""
        free = self.budget_for(step.offload).activation_limit(step.batch, step.length, step.shard_slots)
        return None if free is None else free - resident_bytes(step)

    # -- the budget on the device (docs/MEMORY.md)
    def warm_up(self) -> dict:
        """Measure the workspace a step leaves on the device (mosaic/warmup.py), charge it instead
        of the FIXED_BYTES guess, and from then on run every planned step under the device guard:
        out-of-plan transients from a pre-reserved pool, PyTorch capped at the budget's rest."""
        self.warmup_report = rep = warmup.warm_up(self)
        self.budget = self.budget.with_workspace(rep["workspace_bytes"])
        self.offload_budget = self.offload_budget.with_workspace(rep["workspace_bytes"])
        self.guard = warmup.make_guard(self, rep)
        self._guard_phantom = warmup.phantom_weight_bytes(self.model)   # in the guard's outside_bytes
        self.arena.exact = True
        # the guard caps PyTorch itself: no cache trimming; callbacks hold no engine reference
        self.runner.on_step_done = None
        self.runner.before_step = functools.partial(_guard_step, self.guard, self.arena)
        self.runner.scope = self.guard.scope
        return rep

    def _begin_request(self, adm: Admission | None = None) -> None:
        """After admission, before the request's first tensor: the layers where its mode reads
        them (moved while no cap is set), then the arena cut to its plan, the cache of earlier
        requests handed back, PyTorch capped (memory/transient.py)."""
        adm = adm or self.last_admission
        self._place(adm.prepared.step.offload if adm is not None else self.offload)
        if self.guard is not None and adm is not None:
            _guard_begin(self.guard, self.arena, adm.prepared)

    def _place(self, offload) -> None:
        """The layers where a step of this mode reads them (runtime/placement.py), and the
        guard's view of them: a depth-truncated bench model's phantom layers are charged (and
        capped) only while resident, as admission charges them."""
        self.placement.ensure(offload is not None)
        if self.guard is not None:
            phantom = warmup.phantom_weight_bytes(self.model) if offload is None else 0
            self.guard.outside_bytes += phantom - self._guard_phantom
            self._guard_phantom = phantom

    def _end_request(self) -> None:
        if self.guard is not None:
            self.guard.end()

    # -- admission
    def admit(self, batch: int, length: int, gen: GenerationConfig) -> Admission:
        """Admit a request of `batch` sequences of `length` tokens or raise MemoryBudgetError
        (before anything is allocated) naming the longest that fits, in the last mode tried.
        offload auto: the least streamed mode whose first step fits. Thread-safe."""
        sampler, num_ranks = self.sampler_for(gen), world()[1]

        def step_for(n: int, masked: int):
            return probe_step(self.model, n, masked, gen, batch=batch, cfg_pair=sampler.cfg_pair(gen),
                              shard=self._shard(n))
        rows = sampler.admit_rows(gen, length) if hasattr(sampler, "admit_rows") else sampler.first_masked(gen)
        cached = getattr(sampler, "uses_cache", lambda g: False)(gen)
        itemsize = self.model.dtype.itemsize   # the embedding may be FP8
        layout_for = lambda n, hot: StoreLayout.of(self.model.cfg, batch, n, itemsize, hot)  # noqa: E731
        sp = self.config.sparse   # its steps after the dense ones must fit too
        variants = (lambda s: s.with_(sparse=sp),) if sp is not None and not cached else ()
        # several processes: every rank admits its own share and all reach the same decision
        agree = (lambda v: parallel.agree(v, self.model.device)) if num_ranks > 1 else alone  # noqa: E731
        # a block cache keeps its K/V in its own store (kv_tier): never streamed by the step
        modes = [m for m in candidates(self.config) if not (cached and m == "weights+kv")]
        with self.lock:
            self.last_store_layout = None
            for mode in modes:
                off = offload_of(mode, self.config, self.model.cfg)
                budget = self.budget_for(off)
                mode_step = lambda n, m, off=off: step_for(n, m).with_(offload=off)  # noqa: E731
                # not the last mode: a cheap check first (auto runs on one process only)
                if mode != modes[-1] and not _fits(self.preparer, budget, mode_step(length, rows * batch),
                                                   variants, layout_for(length, self._least_hot()) if cached else None):
                    continue
                layout = None
                if cached:
                    adm, layout = admit_cached(self.preparer, budget, mode_step, length, rows * batch, layout_for,
                                               self.config.kv_tier, min_length=num_ranks)
                else:
                    adm = admit(self.preparer, budget, mode_step, length, rows * batch, min_length=num_ranks,
                                variants=variants, agree=agree, world=num_ranks)
                self._check_host(adm.prepared)
                self.offload, self.last_admission, self.last_store_layout = off, adm, layout
                return adm
        raise AssertionError("unreachable: the last mode admits or raises")

    def _least_hot(self) -> int | None:
        """Layers a block cache keeps on the device at least under kv_tier (None: every layer)."""
        return None if self.config.kv_tier == "device" else 0

    def _check_host(self, prepared) -> None:
        """Streamed K/V needs its host buffers (pinned) next to the offloaded layers: refuse
        before any work when the host cannot hold them (GPU only; on a CPU the budget is host)."""
        host = prepared.template.host_bytes
        if not host or self.model.device.type != "cuda":
            return
        have = host_available_bytes()
        held = self.runner.host_pool.nbytes + self.placement.host_bytes
        need = host + (0 if self.placement.offloaded else sum(self.model.layer_bytes()))
        if have is not None and need > have + held:
            raise MemoryBudgetError(f"streaming K/V from host memory needs {gib(need)} of host memory "
                                    f"(K and V of one sequence, and the offloaded layers); "
                                    f"{gib(have + held)} is available", needed_bytes=need, budget_bytes=have + held)

    def _check_max_length(self, length: int) -> None:
        """max_seq_len (max_length) must fit the budget: a request of that many tokens whose
        canvas is the default max_new_tokens (at most half of it) is admitted, or this raises
        MemoryBudgetError with the longest that fits."""
        default = self.generation_config().max_new_tokens
        probe = GenerationConfig(max_new_tokens=max(1, min(default, length // 2)))
        try:
            self.admit(1, length, probe)
        except MemoryBudgetError as e:
            raise MemoryBudgetError(
                f"max_seq_len {length:,} does not fit the memory budget ({gib(e.budget_bytes)}): a request of "
                f"{length:,} tokens needs at least {gib(e.needed_bytes)}; longest that fits: {e.max_tokens:,} "
                f"tokens", needed_bytes=e.needed_bytes, budget_bytes=e.budget_bytes, max_tokens=e.max_tokens) from None

    def kv_store(self, batch: int, length: int, gen: GenerationConfig) -> KVStore:
        """The K/V store of a cached request, laid out as its admission chose (every layer on the
        device when nothing was admitted, or kv_tier='host': every layer on the host)."""
        layout = self.last_store_layout
        if layout is None or (layout.batch, layout.length) != (batch, length):
            hot = 0 if self.config.kv_tier == "host" else None
            layout = StoreLayout.of(self.model.cfg, batch, length, self.model.dtype.itemsize, hot)
        return KVStore(layout, self.model.device, self.model.dtype)

    # -- reports
    def memory_report(self) -> dict:
        """Where the memory is: weights (on the device and in host memory), arena, PyTorch's
        allocator, context, budget, the guard's cap, the offload mode and precision (bytes)."""
        dev = self.model.device
        adm = self.last_admission
        rep = {"device": str(dev), "weights_bytes": self.model.weight_bytes(),
               "arena": self.arena.kind, "arena_mapped_bytes": self.arena.mapped_bytes,
               "arena_peak_bytes": self.arena.peak_bytes, "budget_bytes": self.budget.budget_bytes,
               "last_prediction_bytes": adm.predicted_bytes if adm else None,
               "workspace_bytes": self.budget.workspace_bytes,
               "torch_limit_bytes": self.guard.limit_bytes if self.guard else None,
               "torch_last_limit_bytes": self.guard.last_limit_bytes if self.guard else None,
               "offload": mode_of(self.offload), "host_weights_bytes": self.placement.host_bytes,
               "host_kv_bytes": self.runner.host_pool.nbytes, "precision": self.precision_report}
        if dev.type == "cuda":
            free, total = torch.cuda.mem_get_info(dev)
            rep |= {"torch_reserved_bytes": torch.cuda.memory_reserved(dev),
                    "torch_peak_reserved_bytes": torch.cuda.max_memory_reserved(dev),
                    "context_bytes": context_bytes(dev) - self.arena_extra_bytes(now=True),
                    "device_used_bytes": total - free, "device_total_bytes": total}
        return rep

    def peak_device_bytes(self) -> int:
        """PyTorch's peak reserved + the arena's mapped peak (GPU); the process RSS peak (CPU)."""
        dev = self.model.device
        if dev.type == "cuda":
            return int(torch.cuda.max_memory_reserved(dev)) + self.arena_extra_bytes()
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def arena_extra_bytes(self, now: bool = False) -> int:
        """Arena bytes PyTorch's allocator does not count (the virtual-memory arena's pages)."""
        if self.arena.kind != "vmm":
            return 0
        return self.arena.physical_bytes if now else self.arena.peak_bytes

    def memory_plot(self, prompts, gen: GenerationConfig, path: str) -> dict:
        """The first step of this request as a PNG: Mosaic's plan (in the engine's current
        offload mode), the native forward recorded, and on a GPU both paths measured op by op.
        Returns the series (bytes per op)."""
        if world()[1] > 1:
            raise InputError("memory plots are drawn for one process: run without --gpus")
        canvas = self.canvas(self.encode(prompts), gen.max_new_tokens)
        B, L = canvas.ids.shape
        step = probe_step(self.model, L, self.sampler.first_masked(gen) * B, gen, batch=B,
                          cfg_pair=self.sampler.cfg_pair(gen)).with_(offload=self.offload)
        prepared = self.preparer.prepare(step, remember=False)
        series = {"Mosaic (planned)": timeline.planned_series(prepared.template),
                  "native forward (recorded, no sampler)": timeline.native_series(self.model, B, L)}
        if self.model.device.type == "cuda":
            one = {"block_length": gen.max_new_tokens} if "block_length" in self.sampler.options else {}
            for native in (True, False):
                probe = timeline.Probe(self.model.device)
                self.generate(prompts, config=gen, native=native, steps=1, progress=False, probe=probe,
                              max_new_tokens=gen.max_new_tokens, **one)
                base = torch.cuda.memory_allocated(self.model.device)
                series[f"{'native' if native else 'Mosaic'} (measured)"] = [
                    u - base + self.arena.mapped_bytes * (not native) for _, u, _ in probe.samples]
        timeline.plot(series, path, f"{self.model.name}: one step, N = {L:,} x {B}")
        return series


def _fits(preparer, budget: Budget, step, variants=(), layout: StoreLayout | None = None) -> bool:
    """Whether a request's first step fits `budget` (with a block cache: charged the least
    device share its tier allows), without the search for the longest that would."""
    try:
        fit(preparer, budget, step if layout is None else with_store(step, layout), variants)
        return True
    except MemoryBudgetError:
        return False


def _guard_step(guard, arena, prepared) -> None:
    """Before a planned step under a budget: the arena cut down to its plan, then the transient
    pool and PyTorch's cap for it (the arena grows after, in the runner)."""
    guard.before_step(prepared.external_bytes, _outside_pages(arena, prepared), arena, prepared.plan_bytes)


def _guard_begin(guard, arena, prepared) -> None:
    """At a request's start: the same for its first (admitted) step, with the cache emptied."""
    guard.begin(prepared.external_bytes, _outside_pages(arena, prepared), arena, prepared.plan_bytes)


def _outside_pages(arena, prepared) -> int:
    return arena_bytes(prepared.plan_bytes, arena.gran) if arena.kind == "vmm" else 0


def _trim_cache(dev, budget, arena, prepared) -> None:
    """Under a budget, hand PyTorch's cached blocks back when they exceed what the plan expects
    outside the arena (the caching allocator keeps freed blocks reserved)."""
    if dev.type != "cuda" or budget.budget_bytes is None:
        return
    allowance = prepared.external_bytes + FIXED_BYTES + resident_bytes(prepared.step) + \
        (prepared.plan_bytes if arena.kind == "host" else 0)
    if torch.cuda.memory_reserved(dev) > allowance:
        torch.cuda.empty_cache()
