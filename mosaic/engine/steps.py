"""Running the calls a sampler yields (runtime/samplers/base.py): the engine-wide executor.

`Executor` turns a RowsCall into a Step (plain, sharded across processes, or a block cache's
fill / block step), prepares it (policy/prepare.py: chunk counts, template, plan) and runs it on
the planned runner; a LogitsCall runs the native forward. What belongs to one request (its
padding mask, its block store, its offload mode, how many steps it has run) travels in a
`RowsState` that the request's run owns, so several requests can be in flight at once."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import torch

from ..config import EngineConfig
from ..graph.shard import current
from ..memory.kv_pool import KVPool, held_bytes
from ..models.batched_attention import varlen_kernel
from ..models.block_cache import stacked_diffusion_step
from ..models.kv_cache import cached_step
from ..models.stacked_cache import stacked_block_step
from ..models.step import make_step
from ..policy.prepare import Preparer
from ..runtime import parallel
from ..runtime.graph_buckets import batch_bucket, key_bucket
from ..runtime.published import check_probabilities, defer_check, segment_nan
from ..runtime.runner import NativeRunner, PlannedRunner
from ..runtime.samplers.base import LogitsCall, RowsCall


@dataclass
class RowsState:
    """One request's side of its planned steps: valid [B, L] bool or None (left padding), its
    block store (a memory.kv_store.KVStore or None), its offload mode (graph.streams.Offload or
    None), the probe called after every op (measurement), the plain steps it has run (the
    first `sparse.dense_steps` stay dense) and interrupt() (True stops a step between two ops:
    runtime/runner.py)."""
    valid: torch.Tensor | None = None
    store: object = None
    offload: object = None
    probe: object = None
    plain_steps: int = 0
    interrupt: object = None       # interrupt() -> bool, asked after every op (cancellation)
    deferred: bool = False         # NaN tests left on the device for the run to read (published.defer_check)
    segments: tuple | None = None  # a stacked step: each request's rows (counts), tested on their own
    pads: tuple | None = None      # each canvas row's left padding, host ints (None: no padding)

    def count_plain_step(self) -> int:
        """The index of the plain step about to run (0 first); counts it."""
        self.plain_steps += 1
        return self.plain_steps - 1


class Executor:
    """Prepare and run steps of one model (shared by every request of an engine)."""

    def __init__(self, model, config: EngineConfig, preparer: Preparer, runner: PlannedRunner,
                 native_runner: NativeRunner, memory, lock: threading.RLock):
        self.model, self.config, self.preparer = model, config, preparer
        self.runner, self.native_runner, self.memory = runner, native_runner, memory
        self.lock = lock
        self.kv_pool = memory.kv_pool              # the engine's device memory holds it (device_memory.py)

    def __call__(self, call, state: RowsState):
        """The outputs of one call: logits [B, L, V] (LogitsCall) or {"x0", "conf"} per masked
        row (RowsCall)."""
        if self.kv_pool is not None and not getattr(self.memory, "in_request", True):
            self.kv_pool.trim()    # a step outside any request (engine.step) is charged no idle K/V buffers
        if isinstance(call, LogitsCall):
            self.memory.place(None)                  # the published forward reads device weights
            return self.native_runner.forward(call.ids, call.valid, state.probe)
        return self.rows(call, state)

    def rows(self, call: RowsCall, state: RowsState) -> dict:
        ids, rows, rows_u, reducer = call.ids, call.rows, call.rows_uncond, call.reducer
        B, L = ids.shape
        valid = state.valid
        if valid is not None and call.canvas_rows is not None:   # several canvases of one row
            valid = valid[call.canvas_rows]
        v = valid if (rows_u is None or valid is None) else torch.cat([valid, valid])
        if call.cache is not None:
            store = state.store
            spec = dataclasses.replace(call.cache, store=store, resident_bytes=held_bytes([store]))
            step = cached_step(self.model.cfg, ids, v, spec, self.config.batch_invariant, self.config.varlen_kernel,
                               rows=rows, reducer=reducer, offload=state.offload, dtype=self.model.dtype)
            store.begin(spec.mode, spec.lo, spec.hi)
            if step.cache.index is not None:
                store.read_by(step.cache.index.kernel)
            outs = self.execute(step, state)
            store.finish()
            return outs
        # sequence parallelism's share of the positions (None under tensor parallelism: every rank
        # runs the whole step over its heads and FFN columns)
        shard = None if self.model.tensor is not None else current(L, self.config.peer_rows, self.config.peer_overlap)
        sp = self.config.sparse
        sparse = sp if sp is not None and state.count_plain_step() >= sp.dense_steps else None
        if shard is None:
            if rows.shape[0] == 0:
                return {k: torch.empty(0, *w, dtype=dt, device=ids.device)
                        for k, dt, *w in reducer.outputs(self.model.dtype)}
            return self.execute(make_step(self.model.cfg, ids, v, dtype=self.model.dtype, rows=rows, rows_uncond=rows_u,
                                          reducer=reducer,
                                          sparse=sparse, offload=state.offload), state)
        # this rank's slots only; every rank gets every slot's result back (all ranks run)
        pos = rows if call.positions is None else call.positions
        shift = self.model.cfg.logit_shift
        idx, local = parallel.localize(pos, L, B if rows_u is None else 2 * B, shard, shift)
        local_u = None if rows_u is None else parallel.localize(rows_u, L, 2 * B, shard, shift)[1]
        step = make_step(self.model.cfg, ids, v, dtype=self.model.dtype, rows=local, rows_uncond=local_u,
                         reducer=reducer.subset(idx),
                         shard=shard, masked_total=int(rows.shape[0]), offload=state.offload)
        return parallel.gather_outs(self.execute(step, state), idx, int(rows.shape[0]), shard)

    def stacked(self, ids, valid, positions, rows, reducer, offload=None, pads=None, interrupt=None) -> dict:
        """One plain step over several requests' canvases stacked into ids [B, L] (engine/
        batching.py): valid [B, L] (False at every left pad), positions [B, L] each request's
        own, rows [M] flat into B x L, one (stacked) reducer; pads: each row's left padding
        (host ints; None: read from valid); interrupt() stops it between two ops (every request in
        it cancelled: engine/batching.py). Outputs as execute's, with "nan" (stacked_state)."""
        v = valid if pads is None or any(pads) else None
        step = make_step(self.model.cfg, ids, v, dtype=self.model.dtype, row_pads=pads, rows=rows, reducer=reducer,
                         offload=offload).with_(positions=positions)
        return self.execute(step, stacked_state(reducer, offload, interrupt))

    def stacked_blocks(self, parts, rows, reducer, offload=None, pads=None, interrupt=None) -> dict:
        """One block step over several requests' block caches (models/stacked_cache.py): parts
        = [(ids [B_i, L_i], valid_i, lo_i, hi_i, store_i)], rows [M] flat over the stacked
        B x n block rows, one (stacked) reducer; pads: per part its rows' left padding (host
        ints) or None (read from valid_i). Where the step can be captured with a kernel
        that reads only device tensors, it is padded to its batch bucket and its key bound
        rounded (runtime/graph_buckets.py), so one graph serves every round of the bucket."""
        m = self.model
        kernel, pad_to, max_k = self._buckets(parts, max(p[0].shape[1] for p in parts))
        step = stacked_block_step(m.cfg, parts, m.dtype, pad_to, max_k, kernel, row_pads=pads, rows=rows,
                                  reducer=reducer, offload=offload)
        used = step.cache.index.kernel if step.cache.index is not None else "loop"   # stores of no common pool
        for _, _, lo, hi, store in parts:
            store.begin("block", lo, hi)
            store.read_by(used)
        outs = self.execute(step, stacked_state(reducer, offload, interrupt))
        for *_, store in parts:
            store.finish()
        return outs

    def stacked_block_diffusion(self, parts, block: int, rows, reducer, interrupt=None) -> dict:
        """One step over several block-diffusion requests' block steps (models/block_cache.
        stacked_diffusion_step): parts = [(canvas ids [B_i, W_i], pads_i, a_i, hi_i, store_i)],
        rows [M] flat over the stacked B x n rows, one (stacked) reducer. Captured: padded to its
        batch bucket with its key bound rounded, so one graph serves every round of the bucket."""
        m = self.model
        kernel, pad_to, max_k = self._buckets(parts, max(p[3] for p in parts))
        step = stacked_diffusion_step(m.cfg, parts, block, kernel, pad_to, max_k, rows=rows, reducer=reducer)
        for ids, _, a, _, store in parts:
            store.begin("block", a, ids.shape[1])
            store.read_by(kernel)
        outs = self.execute(step, stacked_state(reducer, interrupt=interrupt))
        for *_, store in parts:
            store.finish()
        return outs

    def _buckets(self, parts, max_keys: int) -> tuple[str, int | None, int | None]:
        """(varlen kernel, batch bucket, key bucket) of a stacked step over `parts` (their ids
        [B_i, ...] first) whose longest sequence has max_keys keys: buckets only where the step can
        be captured with a kernel that reads device tensors only (runtime/graph_buckets.py)."""
        m = self.model
        kernel = varlen_kernel(m.cfg, m.device, m.dtype, self.config.batch_invariant, self.config.varlen_kernel)
        g = self.runner.graphs
        if g is None or not g.allowed() or kernel == "loop":
            return kernel, None, None
        pad_to = batch_bucket(sum(p[0].shape[0] for p in parts))
        return kernel, pad_to, key_bucket(max_keys) if pad_to is not None else None

    def execute(self, step, state: RowsState) -> dict:
        """Prepare (one at a time: the preparer's caches are shared) and run a planned step; its
        confidences are checked for NaN here, outside any captured graph (published.py): read
        now, deferred to the request's readback (state.deferred), or, for a stacked step
        (state.segments), one flag per request left on the device as output "nan" [S] bool
        (published.segment_nan), which each request's run holds and reads with its own readback
        (engine/batching.py): a stacked step never makes the host wait for it."""
        self.memory.place(step.offload)        # layers where this mode reads them
        with self.lock:
            prepared = self.preparer.prepare(step)
        outs = self.runner.execute(step, prepared, state.probe, state.interrupt)
        if "conf" not in outs:
            return outs
        if state.segments is not None:
            nan = segment_nan(outs["conf"], state.segments)
            if nan is not None:
                outs["nan"] = nan
        else:   # a request's run reads the test with its step's readback (published.py)
            (defer_check if state.deferred else check_probabilities)(outs["conf"], self.model.dtype)
        return outs


def stacked_state(reducer, offload=None, interrupt=None) -> RowsState:
    """The state of a stacked step (engine/batching.py): its offload mode, its requests' row
    counts (reducer: a StackedReducer), whose NaN tests execute() splits per request, and
    interrupt() (None: it runs to its end)."""
    return RowsState(offload=offload, segments=tuple(reducer.counts), interrupt=interrupt)


def kv_pool_for(model, has_budget: bool) -> KVPool:
    """The engine's paged pool of device-tier block stores (memory/kv_pool.py), on every device.
    Under a budget it is exact: its buffers hold the allocated pages (grown to exactly what a
    joining store needs, never shrunk by a copy, kept idle when the last store leaves so that the
    next request of that size replays its captured steps), and every byte they hold is charged
    before it is: the Scheduler admits a joining request only where the stacked step fits with the
    pool's `peak_bytes` for its store (engine/scheduler.py `fits`: idle buffers included, given
    back first where the join needs them), and a request starting keeps idle buffers only where
    its admission leaves room for them (engine/run.py idle_pool_beyond)."""
    cfg = model.cfg
    return KVPool(cfg.num_layers, cfg.kv_dim, model.dtype, model.device, exact=has_budget)
