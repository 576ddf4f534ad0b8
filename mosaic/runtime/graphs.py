"""Captured planned steps: a step program replayed as one CUDA graph instead of ~1,400 kernel
launches and ~5,000 ATen calls from Python.

Why it works here: a planned step already puts every activation at a fixed offset of one arena
(the virtual-memory arena's base never moves), the weights and a device-tier block store stay
where they are, and a step's random draws come from a generator the replay advances. So a step's
kernels can be captured once and replayed with only its inputs rewritten in place: the canvas ids
[B, L'], the positions [B, L'] and the masked rows [M], copied into static input tensors that all
graphs of one shape share (replays never overlap).

Buckets: the masked count falls during a request, and the Preparer already plans every step of a
shape for the largest count seen (policy/prepare.py capped). A captured step takes that count:
the real rows are padded by repeating the last one (their outputs are dropped), so one graph
serves every step of the shape. The extra rows cost their logits only (32 rows x d x V: ~0.04 ms
on an H200 for LLaDA-8B). A block step writes its fresh K/V at rows [lo, hi) of the store, an
address: each block gets its own graph (8 for 256 tokens in blocks of 32).

Random draws: the replay draws from the request's stream, advanced after it by what the eager
step draws for its real rows (graph_backend.py); where the published code branches on the host,
flags instead (graph_rules.host_flags): "ok" False reruns the step eagerly (the stream restored;
after REDO_LIMIT its shape stays eager), "drew" False (no draw) keeps the replay, stream unmoved.

Capture happens on the second run of a step's shape on the same thread (the first, eager, loads
kernels, runs Triton's autotuning and makes what libraries create per thread on first use:
cuBLAS/cuBLASLt handles and workspaces of the thread's stream, cuDNN's handle; made inside a
capture they invalidate it: a server's engine thread whose first step of a shape the main thread
had seen failed its captures, bench/results/gpu/session7/everyday_2a23023.log); a capture that
fails (an op that synchronises with the host, say) leaves that shape eager for good, is counted in
`stats`, and the pool it recorded into is replaced (`on_failure`): a failed capture must not leave
the allocator recording into a pool a later capture uses.

Memory. Without a budget the graphs share the backend's own pool. Under a budget the guard's
transient pool is theirs (memory/transient.py, graph mode: sized to the step's out-of-plan peak,
reserved before the step, kept across replays and requests), `pool()` hands it to a capture, and
what a graph holds outside PyTorch (its executable, measured at its first replay) and its shape's
static inputs (inside PyTorch) are held under `limits` by dropping the least recently used
graphs (admission charged them: policy/graph_charge.py).

Eligible: CUDA, no offload, no sequence parallelism, no block-sparse layout estimation, a
device-tier store, no probe, no cfg, a reducer whose draws a graph can replay.

The backend is an interface (graph_backend.CudaGraphs, or a fake for the CPU tests), so the
bookkeeping (keys, padding, capture on the second run, fallback, LRU, draws) is tested without
a GPU."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..models.step import Step
from . import graph_rules as GR
from .graph_rules import (
    DEFAULT_BYTES_PER_OP,
    eligible,
    executed_ops,
    make_static_inputs,
    reducer_draws,
    static_inputs,
    step_inputs,
)

__all__ = ["MAX_GRAPHS", "Captured", "GraphStats", "StepGraphs", "eligible", "reducer_draws", "step_inputs"]

MAX_GRAPHS = 64   # captured steps kept (LRU); each holds no activation memory of its own
REDO_LIMIT = 4    # replays of a shape rerun eagerly (draws that took a host branch) before it stays eager


@dataclass
class Captured:
    """One captured step: its graph, the static inputs it reads (rewritten before each replay),
    the output tensors it writes, whether it draws, and what it holds outside PyTorch."""
    graph: object
    inputs: dict
    outputs: dict[str, torch.Tensor]
    draws: bool = False
    ops: int = 0
    driver_bytes: int | None = None       # measured at its first replay
    before: tuple | None = None           # the device's counters before the capture
    replays: int = 0

    def replayed(self) -> None:
        self.replays += 1

    def measured(self, driver_bytes: int) -> None:
        self.driver_bytes = driver_bytes


@dataclass
class GraphStats:
    """Counters of a StepGraphs (for --json, Generation.stats and the benchmarks)."""
    captures: int = 0
    replays: int = 0
    eager: int = 0
    redone: int = 0            # replays whose draws took a host branch: rerun eagerly
    one_row: int = 0           # eager because a one-row scan differs from the padded one (run)
    evicted: int = 0
    capture_ms: float = 0.0
    pool_bytes: int = 0
    driver_bytes: int = 0      # graph executables held now (measured)
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"captures": self.captures, "replays": self.replays, "eager": self.eager, "redone": self.redone,
                "one_row": self.one_row, "evicted": self.evicted, "capture_ms": self.capture_ms,
                "pool_bytes": self.pool_bytes, "driver_bytes": self.driver_bytes, "failures": list(self.failures)}

    def snapshot(self) -> dict:
        return {"captures": self.captures, "replays": self.replays, "eager": self.eager, "redone": self.redone,
                "failures": len(self.failures)}


POISONED = "already recording"   # a capture error after which the allocator stays in capture mode


class StepGraphs:
    """Captured steps of one engine, keyed by everything the kernels' addresses and shapes
    depend on. backend: graph_backend.CudaGraphs (default on CUDA) or a fake. allowed(): may
    a step be captured now; pool(): the budget guard's (pool id, stream) a capture must use, or
    None (the backend's own)."""

    def __init__(self, backend, max_graphs: int = MAX_GRAPHS, allowed: Callable[[], bool] | None = None,
                 pool: Callable[[], object] | None = None, vocab: int = 0, dtype: torch.dtype = torch.float32):
        self.backend, self.max_graphs = backend, max_graphs
        self.vocab, self.dtype = vocab, dtype       # the model's: what a reducer's draws are over
        self.allowed = allowed or (lambda: True)
        self.pool = pool or (lambda: None)
        self.on_failure: Callable[[], None] = lambda: None   # a capture failed: its pool is not to be reused
        self.graphs: OrderedDict = OrderedDict()
        self.inputs: dict = {}               # input key -> static inputs shared by that shape's graphs
        self.seen: set = set()               # (thread id, shape) run eagerly on that thread
        self.failed: set = set()
        self.redone: dict = {}               # shape -> replays rerun eagerly (their draws branched)
        self.no_room: set = set()            # shapes whose graph the limits cannot hold (until they change)
        self.stats = GraphStats()
        self.driver_limit: int | None = None  # bytes the executables may hold (None: no limit)
        self.inputs_limit: int | None = None  # bytes the static inputs may hold
        self.bytes_per_op = 0.0               # the most an executable took per op of its step (measured)

    def bind(self, allowed: Callable[[], bool], pool: Callable[[], object],
             on_failure: Callable[[], None] | None = None) -> None:
        """Capture only while allowed(), into pool() (the owner's budget guard: engine/device_memory.py);
        on_failure(): a capture into that pool failed, the owner replaces the pool."""
        self.allowed, self.pool = allowed, pool
        if on_failure is not None:
            self.on_failure = on_failure

    # -- keys and inputs
    def key(self, step: Step, prepared, arena_ptr: int) -> tuple:
        cache = step.cache
        where = () if cache is None else (*cache.where(), cache.store.address() if cache.store is not None else 0)
        return (prepared.key, tuple(step.ids.shape), arena_ptr, where)

    def _inputs_for(self, step: Step, cap: int) -> dict:
        key, nbytes, extra = static_inputs(step, cap)
        got = self.inputs.get(key)
        if got is None:
            got = self.inputs[key] = {**make_static_inputs(step, cap, extra), "users": 0, "bytes": nbytes, "key": key}
        return got

    @staticmethod
    def _write(inputs: dict, step: Step, m: int, cap: int) -> None:
        """The step's inputs into the static tensors, rows padded to cap by repeating the last
        (no allocation: a replay must not take memory the budget did not plan)."""
        for name, t in step_inputs(step).items():
            if name != "rows":
                inputs[name].copy_(t)
        rows = inputs["rows"]
        rows[:m].copy_(step.rows)
        if cap > m:
            rows[m:].copy_(step.rows[m - 1:m].expand(cap - m))

    # -- running
    def run(self, step: Step, prepared, launch: Callable[[Step], dict], arena_ptr: int) -> dict | None:
        """The step's outputs ({name: [M, ...]}, views the caller copies before the next step),
        or None when it must run eager (the caller runs it). launch(step) runs the program on the
        arena and returns its outputs."""
        key = self.key(step, prepared, arena_ptr)
        shape_key = key[:2]
        if shape_key in self.failed or shape_key in self.no_room:
            return None
        m, cap = step.num_masked, prepared.step.num_masked
        if m == 1 < cap and getattr(step.reducer, "one_row_scan", False):
            # torch.cumsum over a tensor of one row runs CUB's device-wide scan, over many rows a
            # per-row scan with another summation order: top-p's cut of the reference's single
            # row is only reproduced unpadded (H200: Dream top_p 0.95 captured != eager at the
            # 1-row steps, bench/results/gpu/session7/run4_cebfa5a.log), so that step runs eager
            self.stats.eager += 1
            self.stats.one_row += 1
            return None
        got = self.graphs.get(key)
        if got is None:
            here = (threading.get_ident(), shape_key)
            if here not in self.seen:   # the shape's first run on this thread: eager (module docstring)
                self.seen.add(here)
                self.stats.eager += 1
                return None
            got = self._capture(key, shape_key, step, prepared, launch, m, cap)
            if got is None:
                return None
        self.graphs.move_to_end(key)
        self._write(got.inputs, step, m, cap)
        return self._replay(got, shape_key, step, prepared, m, cap)

    def _replay(self, got: Captured, shape_key, step: Step, prepared, m: int, cap: int) -> dict | None:
        red = step.reducer
        token = self.backend.load(red.generator) if got.draws else None
        self.backend.replay(got.graph)
        got.replayed()
        self.stats.replays += 1
        if got.driver_bytes is None:
            self._measured(got)
        outs = {k: v[:m] for k, v in got.outputs.items()}
        ok, drew = GR.host_flags(outs)
        if token is not None and not (ok and drew):   # rerun eagerly, or the argmax without a draw
            self.backend.restore(token)
        if not ok:                                         # a host branch of the published code
            self.stats.redone += 1
            self.redone[shape_key] = self.redone.get(shape_key, 0) + 1
            if self.redone[shape_key] >= REDO_LIMIT:         # it keeps branching: leave the shape eager
                self.failed.add(shape_key)
            return None
        if token is not None and drew:
            V, dt, fused = self.vocab, self.dtype, prepared.fused
            self.backend.advance(token, red.draw_calls(m, V, dt, fused), red.draw_calls(cap, V, dt, fused))
        return outs

    def _capture(self, key, shape_key, step: Step, prepared, launch, m: int, cap: int) -> Captured | None:
        ops = executed_ops(prepared.template)
        key_in, in_bytes, _ = static_inputs(step, cap)
        if not self._make_room(ops, 0 if key_in in self.inputs else in_bytes):   # eager while the limits stay
            if shape_key not in self.no_room:
                self.stats.failures.append("graph memory: what the budget leaves graphs cannot hold this step's")
            self.no_room.add(shape_key)
            return None
        inputs = self._inputs_for(step, cap)
        self._write(inputs, step, m, cap)
        static = step.with_(ids=inputs["ids"], positions=inputs["positions"], rows=inputs["rows"])
        if step.cache is not None and hasattr(step.cache, "graph_inputs"):     # a batched block step's index
            static = static.with_(cache=step.cache.with_graph_inputs(inputs))
        draws = reducer_draws(step.reducer)
        if draws:
            static = static.with_(reducer=step.reducer.with_generator(self.backend.generator))
        t0, before = time.perf_counter(), self.backend.measure()
        try:
            graph, outs = self.backend.capture(lambda: launch(static), pool=self.pool(), draws=draws)
        except Exception as e:   # an op that cannot be captured: this shape stays eager
            self.failed.add(shape_key)
            self.stats.failures.append(f"{type(e).__name__}: {str(e)[:160]}")
            if inputs["users"] == 0:
                self.inputs.pop(inputs["key"], None)
            if POISONED in str(e):   # the allocator could not be unwound: no more captures
                self.allowed = lambda: False
            self.on_failure()
            return None
        self.stats.capture_ms += (time.perf_counter() - t0) * 1e3
        self.stats.captures += 1
        inputs["users"] += 1
        got = Captured(graph, inputs, outs, draws, ops, before=before)
        self.graphs[key] = got
        while len(self.graphs) > self.max_graphs:
            self._evict()
        return got

    # -- what graphs hold
    def _measured(self, got: Captured) -> None:
        """A new graph's executable, measured after its first replay: the driver's growth
        since before its capture less PyTorch's (its pool; under a budget nothing grows)."""
        used, reserved = self.backend.measure()
        used0, reserved0 = got.before
        got.measured(max(0, (used - used0) - (reserved - reserved0)))
        self.stats.pool_bytes += max(0, reserved - reserved0)
        self.stats.driver_bytes += got.driver_bytes
        if got.ops:
            self.bytes_per_op = max(self.bytes_per_op, got.driver_bytes / got.ops)
        while self.driver_limit is not None and self.stats.driver_bytes > self.driver_limit and len(self.graphs) > 1:
            self._evict()

    def estimate(self, ops: int) -> int:
        """Bytes an executable of a step of `ops` ops is expected to take (the most per op
        measured so far, or DEFAULT_BYTES_PER_OP before any, with a quarter more)."""
        return int(1.25 * (self.bytes_per_op or DEFAULT_BYTES_PER_OP) * ops)

    def _make_room(self, ops: int, new_inputs: int) -> bool:
        """Drop least recently used graphs until a new one of `ops` ops (and `new_inputs` bytes
        of static inputs) fits the limits (none when it would not fit even alone)."""
        need = self.estimate(ops)
        if (self.driver_limit is not None and need > self.driver_limit) or \
                (self.inputs_limit is not None and new_inputs > self.inputs_limit):
            return False
        while self.graphs and not self._fits(need, new_inputs):
            self._evict()
        return self._fits(need, new_inputs)

    def _fits(self, need: int, new_inputs: int) -> bool:
        if self.driver_limit is not None and self.stats.driver_bytes + need > self.driver_limit:
            return False
        return self.inputs_limit is None or self.inputs_bytes() + new_inputs <= self.inputs_limit

    def inputs_bytes(self) -> int:
        return sum(v["bytes"] for v in self.inputs.values())

    def _evict(self) -> None:
        _, got = self.graphs.popitem(last=False)
        self._release(got)
        self.stats.evicted += 1

    def _release(self, got: Captured) -> None:
        self.stats.driver_bytes -= got.driver_bytes or 0
        got.inputs["users"] -= 1
        if got.inputs["users"] <= 0:
            self.inputs.pop(got.inputs["key"], None)

    def set_limits(self, driver_bytes: int | None, inputs_bytes: int | None) -> None:
        """Hold the executables and static inputs under these bytes (None: no limit), dropping
        the least recently used graphs now if they hold more."""
        self.driver_limit, self.inputs_limit = driver_bytes, inputs_bytes
        self.no_room.clear()
        while self.graphs and not self._fits(0, 0):
            self._evict()

    def drop_graphs(self) -> None:
        """Drop every graph (their pool is about to go), keeping what was learnt: the shapes
        seen (the next run of each captures again) and those that cannot be captured."""
        while self.graphs:
            self._release(self.graphs.popitem(last=False)[1])
        self.inputs.clear()
        self.stats.driver_bytes = 0

    def clear(self) -> None:
        """Drop every graph and forget every shape (an engine that is closed)."""
        self.drop_graphs()
        self.seen.clear()
        self.failed.clear()
        self.redone.clear()
        self.no_room.clear()
