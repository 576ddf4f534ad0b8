"""The one answer to "does this request fit?" and "what is the longest that fits?".

An `Admitter` is built from a model (real or on meta tensors), the engine's options, a Preparer
and the budget of each offload mode. Run-time admission (the engine), `mosaic plan` (capacity.py),
the server's advertised capacity and the benchmarks all ask it, so one request shape gets one
L_max everywhere. Nothing is allocated: every step is prepared on meta tensors.

A request fits when, on every rank, its first step (the most masked rows it will ever have)
and a late step (a tenth of them masked) fit the budget after lazy chunking, with the steps of
the other kinds it will run (block-sparse steps after the dense ones) and a block cache's
persistent K/V charged on top (policy/kv_tier.py). `offload: auto` takes the least streamed mode
that fits (policy/offload.py). A refusal names the longest request of the same shape that fits:
the same canvas share of the sequence, searched in steps of 1,024 tokens as `mosaic plan` does
(to the token below 1,024)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from ..config import EngineConfig, GenerationConfig
from ..errors import MemoryBudgetError, gib
from ..memory.kv_store import StoreLayout
from . import graph_charge
from .admission import Admission, alone, fit, longest, resident_bytes
from .block_admission import block_of, request_probe
from .kv_tier import check_host, with_store
from .offload import candidates, offload_of
from .prepare import Preparer
from .probe import probe_step

RATIOS = (1.0, 0.1)   # masked share of the first step's rows: the first step and a late one
GRID = 1024           # L_max is searched in steps of this many tokens (mosaic plan's table)
# gen_for(n) -> the options of the request of n tokens in a shape (its canvas, its blocks)
GenFor = Callable[[int], GenerationConfig]


def scaled(gen: GenerationConfig, length: int) -> GenFor:
    """The shape of a request of `length` tokens with options `gen`: at n tokens the canvas
    keeps its share of the sequence (at least 1 token) and blocks are cut to the canvas."""
    def gen_for(n: int) -> GenerationConfig:
        # at least one prompt token: a canvas of nearly all the request (a 15-token prompt and
        # 100M new tokens) rounded to n at every n, so no length had a prompt and the refusal
        # said "longest that fits: 0 tokens"
        canvas = max(1, min(n - 1, round(gen.max_new_tokens * n / length)))
        block = None if gen.block_length is None else min(gen.block_length, canvas)
        return dataclasses.replace(gen, max_new_tokens=canvas, block_length=block)
    return gen_for


def split(gen: GenerationConfig, canvas_share: float) -> GenFor:
    """`mosaic plan`'s shape: a canvas of canvas_share * n tokens (prompt = the rest)."""
    def gen_for(n: int) -> GenerationConfig:
        canvas = max(1, round(canvas_share * n))
        block = None if gen.block_length is None else min(gen.block_length, canvas)
        return dataclasses.replace(gen, max_new_tokens=canvas, block_length=block)
    return gen_for


def first_true(pred, lo: int, hi: int) -> int | None:
    """The smallest n in [lo, hi] with pred(n) (pred monotone: false, then true), or None."""
    if lo > hi:
        return None
    if pred(lo):
        return lo
    step = 1
    while lo + step <= hi and not pred(lo + step):
        step *= 2
    a, b = lo + step // 2, min(hi, lo + step)     # pred(a) false (or a == lo), pred(b) maybe true
    if not pred(b):
        return None
    while b - a > 1:
        mid = (a + b) // 2
        a, b = (a, mid) if pred(mid) else (mid, b)
    return b


class Admitter:
    """Admission and L_max for one model under one set of budgets.

    budget_of(offload) -> Budget: the budget view of a mode (its weights charged). sampler_of(gen)
    -> Sampler: the request's sampler (it says how many rows its largest step has, whether it
    keeps a cache). shards(n) -> the shards of this process to check at n tokens (default
    [None]: one process; `mosaic plan --gpus K` checks the largest and the last rank's share).
    agree(list[int]) -> the elementwise minimum over every process (one process: its own).
    check_admitted(admission): a last check of what the request needs outside the budget (the
    engine's host-memory check for streamed K/V); raises MemoryBudgetError. graphs: the engine's
    StepGraphs (None: never captured): an admitted request is charged its graphs where they fit
    what its steps leave of the budget, else it runs eager (policy/graph_charge.py)."""

    def __init__(self, model, config: EngineConfig, preparer: Preparer, budget_of, sampler_of, *,
                 shards=None, agree=alone, world: int = 1, check_admitted=None, lock=None, graphs=None):
        self.model, self.config, self.preparer = model, config, preparer
        self.graphs = graphs      # the engine's StepGraphs: what captured steps cost (graph_charge.py)
        self.budget_of, self.sampler_of = budget_of, sampler_of
        self.shards = shards or (lambda n: [None])
        self.agree, self.world = agree, world
        self.check_admitted = check_admitted
        self.ratios = RATIOS
        # admission may run on a server's thread while a request runs on another: the preparer's
        # caches are shared, so one at a time
        self.lock = lock or threading.RLock()

    # -- the modes and the store
    def modes(self, cached: bool) -> list[str]:
        """Offload modes to try, least streamed first (a block cache keeps its K/V in its own
        store: never streamed by the step)."""
        return [m for m in candidates(self.config) if not (cached and m == "weights+kv")]

    def layout(self, batch: int, length: int, hot: int | None, gen: GenerationConfig | None = None) -> StoreLayout:
        """A block cache's store of batch x length tokens with `hot` layers on the device (a
        block-diffusion canvas: length rounded up to whole blocks)."""
        if self.model.cfg.block_causal and gen is not None:
            bl = block_of(self.model, gen)
            length = -(-length // bl) * bl
        return StoreLayout.of(self.model.cfg, batch, length, self.model.dtype.itemsize, hot)

    def store_bytes(self, batch: int, n: int, gen: GenerationConfig) -> int:
        """Device bytes `need` charges a request of batch x n tokens for its block store (every
        layer on the device): its layout's pages when it keeps a cache, else 0."""
        if not (self.model.cfg.block_causal or self.sampler_of(gen).uses_cache(gen)):
            return 0
        return self.layout(batch, n, None, gen).device_bytes

    def least_hot(self) -> int | None:
        """Layers a block cache keeps on the device at least under kv_tier (None: every layer)."""
        return None if self.config.kv_tier == "device" else 0

    # -- one length
    def need(self, batch: int, n: int, gen: GenerationConfig, offload=None, hot: int | None = None,
             constrained: bool = False, extra_bytes: int = 0):
        """(Prepared of the first step or None, activation bytes needed) for a request of batch x
        n tokens with options gen in one offload mode, on this process's shards; a cached
        request's store has `hot` layers on the device (None: every layer). constrained: an
        output constraint's steps (their window's rows, the saved logits and the walk's bytes:
        runtime/samplers/constrained_reducer.py) instead of the unconstrained ones. extra_bytes:
        device bytes held besides the store (the K/V pool's growth, idle buffers: scheduler.py fits),
        charged as resident bytes of every step."""
        if self.model.cfg.block_causal:   # block diffusion: its largest step with its block store
            return self._need_blocks(batch, n, gen, hot, constrained, extra_bytes)
        sampler = self.sampler_of(gen)
        cached = sampler.uses_cache(gen)
        batch *= sampler.canvases(gen)     # self-speculative verification: several canvases a row
        rows = (sampler.constrained_rows(gen, n) if constrained else sampler.admit_rows(gen, n)) * batch
        sparse = self.config.sparse
        variants = (lambda s: s.with_(sparse=sparse),) if sparse is not None and not cached else ()
        budget = self.budget_of(offload)
        first, most = None, 0
        for shard in self.shards(n):
            for ratio in self.ratios[:1] if cached else self.ratios:   # a cached request's fill step is its largest
                step = probe_step(self.model, n, max(1, round(rows * ratio)), gen, batch=batch,
                                  cfg_pair=sampler.cfg_pair(gen), shard=shard, constrained=constrained,
                                  accelerated=sampler.accelerated).with_(offload=offload)
                if cached or extra_bytes:
                    step = with_store(step, self.layout(batch, n, hot), extra_bytes, cached)
                try:
                    prepared = fit(self.preparer, budget, step, variants)
                except MemoryBudgetError as e:
                    return None, max(most, e.needed_bytes)
                most = max(most, prepared.need_bytes + resident_bytes(step))
                first = first or prepared
        return first, most

    def _need_blocks(self, batch: int, n: int, gen: GenerationConfig, hot: int | None, constrained: bool = False,
                     extra_bytes: int = 0):
        step, others = request_probe(self.model, batch, n - gen.max_new_tokens, gen.max_new_tokens, gen, hot=hot,
                                     itemsize=self.model.dtype.itemsize, constrained=constrained,
                                     extra_bytes=extra_bytes)
        try:
            prepared = fit(self.preparer, self.budget_of(None), step, others)
        except MemoryBudgetError as e:
            return None, e.needed_bytes
        return prepared, prepared.need_bytes + resident_bytes(step)

    def fits(self, batch: int, n: int, gen: GenerationConfig, offload=None, hot: int | None = None,
             constrained: bool = False, extra_bytes: int = 0) -> bool:
        """Whether a request of batch x n tokens fits with extra_bytes held besides (need;
        thread-safe: the engine's Scheduler asks from its thread while a server admits on
        others; the preparer's caches are shared)."""
        with self.lock:
            return self.need(batch, n, gen, offload, hot, constrained, extra_bytes)[0] is not None

    def batch_graphs(self, batch: int, n: int, gen: GenerationConfig, constrained: bool = False,
                     extra_bytes: int = 0) -> tuple[graph_charge.GraphCharge, int | None]:
        """The graph charge of a running batch's stacked step (batch rows of at most n tokens,
        `extra_bytes` held besides, as the Scheduler admitted it: scheduler.py fits), from what
        that step leaves of the resident budget, as admit charges one request's; and its
        activation bytes spare before the charge (None: no budget). A batch whose step no longer
        fits (it never should: the Scheduler checked) runs eager. Thread-safe."""
        with self.lock:
            prepared, need = self.need(batch, n, gen, None, None, constrained, extra_bytes)
            if prepared is None:
                return graph_charge.GraphCharge(False, note="eager: the stacked step does not fit"), None
            return self._graph_charge(prepared, need, None)

    def _graph_charge(self, prepared, need: int, offload, layout=None) -> tuple[graph_charge.GraphCharge, int | None]:
        """(the graph charge of a step that needs `need` activation bytes in `offload`'s mode,
        the activation bytes it leaves spare: None without a budget) (policy/graph_charge.py)."""
        step = prepared.step
        limit = self.budget_of(offload).activation_limit(step.batch, step.length, step.shard_slots)
        spare = None if limit is None else limit - need
        return graph_charge.charge(self.graphs, prepared, spare, layout), spare

    # -- admission
    def admit(self, batch: int, length: int, gen: GenerationConfig, constrained: bool = False) -> Admission:
        """Admit a request of `batch` sequences of `length` tokens or raise MemoryBudgetError
        (before anything is allocated) saying what it needs, what the budget is and the longest
        request of its shape that fits, in the last mode tried. constrained: the request has an
        output constraint (its steps are charged as they run: need). Thread-safe."""
        cached = self.sampler_of(gen).uses_cache(gen)
        modes = self.modes(cached)
        with self.lock:
            for mode in modes:
                off = offload_of(mode, self.config, self.model.cfg)
                hot = self._hot(batch, length, gen, off, constrained) if cached else None
                prepared, need = self.need(batch, length, gen, off, hot, constrained)
                ok, neg_need = self.agree([int(prepared is not None), -need])
                if ok:
                    layout = self.layout(batch, length, hot, gen) if cached else None
                    if layout is not None:
                        check_host(layout)
                    budget = self.budget_of(off)
                    step = prepared.step
                    graphs, _ = self._graph_charge(prepared, -neg_need, off, layout)
                    adm = Admission(prepared, budget.total(-neg_need, step.batch, step.length, step.shard_slots)
                                    + graphs.total_bytes, budget.budget_bytes, off, layout, graphs)
                    if self.check_admitted is not None:
                        self.check_admitted(adm)
                    return adm
                if mode != modes[-1]:
                    continue
                self._refuse(batch, length, gen, off, hot, -neg_need, constrained)
        raise AssertionError("unreachable: the last mode admits or raises")

    def _hot(self, batch: int, length: int, gen: GenerationConfig, offload, constrained: bool = False) -> int | None:
        """The most layers of a block cache's store that fit on the device (kv_tier auto), the
        tier's own choice otherwise (host: none; device, or no budget: every layer)."""
        n_layers = self.model.cfg.num_layers
        tier = self.config.kv_tier
        if tier == "host":
            return 0
        if tier == "device" or self.budget_of(offload).budget_bytes is None:
            return None
        if self.fits(batch, length, gen, offload, None, constrained):
            return None
        if not self.fits(batch, length, gen, offload, 0, constrained):
            return 0            # not even on the host: the refusal names what would fit
        lo, hi = 0, n_layers - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(batch, length, gen, offload, mid, constrained):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _refuse(self, batch: int, length: int, gen: GenerationConfig, offload, hot, need: int,
                constrained: bool = False):
        best = self.longest(batch, scaled(gen, length), hi=length, offload=offload, constrained=constrained)
        budget = self.budget_of(offload)
        sampler = self.sampler_of(gen)
        canvases = batch * sampler.canvases(gen)
        step = probe_step(self.model, length, sampler.admit_rows(gen, length) * canvases, gen, batch=canvases,
                          cfg_pair=sampler.cfg_pair(gen), shard=self.shards(length)[0])
        total = budget.total(need, step.batch, step.length, step.shard_slots)
        resident = self.layout(batch, length, hot, gen).device_bytes if self.sampler_of(gen).uses_cache(gen) else 0
        kv = f" (of which a block cache's K/V {gib(resident)})" if resident else ""
        per, on = (" per GPU", f" on {self.world} GPUs") if self.world > 1 else ("", "")
        # two sizes that round alike ("needs 0.33 GiB; budget is 0.33 GiB") are shown to the byte
        size = gib if gib(total) != gib(budget.budget_bytes) else (lambda b: f"{b:,} bytes")
        grid = f" (on a {GRID:,}-token grid)" if best >= GRID else ""
        raise MemoryBudgetError(
            f"request of {batch} x {length:,} tokens needs at least {size(total)}{per}{kv}; budget is "
            f"{size(budget.budget_bytes)}{per} (weights {gib(budget.weights_bytes)}, context and workspace "
            f"{gib(budget.fixed_bytes - budget.weights_bytes)}); longest that fits{on}: {best:,} tokens{grid}",
            needed_bytes=total, budget_bytes=budget.budget_bytes, max_tokens=best)

    # -- the longest that fits
    def longest(self, batch: int, gen_for: GenFor, hi: int, lo: int | None = None, unit: int | None = None,
                offload=None, constrained: bool = False) -> int:
        """The longest n in [lo, hi] tokens whose request (options gen_for(n)) fits, the same on
        every process (the shortest of the ranks' longest). unit None: multiples of GRID (mosaic
        plan's grid), or to the token where not even GRID tokens fit; else multiples of unit.
        A block cache is charged the least device share its tier allows (hot layers)."""
        hot = self.least_hot()

        def valid(n):   # the shape has a prompt at n tokens (at least one token besides the canvas)
            return n > gen_for(n).max_new_tokens
        lo = first_true(valid, max(lo or 2, self.world), hi)
        if lo is None:
            return 0

        def ok(n):
            return valid(n) and self.fits(batch, n, gen_for(n), offload, hot, constrained)
        with self.lock:
            if unit is not None:
                best = longest(ok, lo, hi, unit)
            else:
                best = longest(ok, max(lo, GRID), hi, GRID) or longest(ok, lo, min(hi, GRID - 1), 1)
        return self.agree([best])[0]
