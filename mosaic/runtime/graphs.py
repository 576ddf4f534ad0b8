"""Captured planned steps: a step program replayed as one CUDA graph instead of ~1,400 kernel
launches and ~5,000 ATen calls from Python.

Why it works here: a planned step already puts every activation at a fixed offset of one arena
(the virtual-memory arena's base never moves), the weights and a device-tier block store stay
where they are, and the greedy reducers draw nothing. So a step's kernels can be captured once
and replayed with only its inputs rewritten in place: the canvas ids [B, L'], the positions
[B, L'] and the masked rows [M] (copied into the captured input tensors).

Buckets: the masked count falls during a request, and the Preparer already plans every step of a
shape for the largest count seen (policy/prepare.py capped). A captured step takes that count:
the real rows are padded by repeating the last one (their outputs are dropped), so one graph
serves every step of the shape. The extra rows cost their logits only (32 rows x d x V: ~0.04 ms
on an H200 for LLaDA-8B). A block cache's block step writes its fresh K/V at rows [lo, hi) of the
store, an address: each block gets its own graph (8 for 256 tokens in blocks of 32).

Capture happens on the second run of a step's shape (the first, eager, loads kernels and runs
Triton's autotuning, which cannot be captured); a capture that fails (an op that synchronises
with the host, say) leaves that shape eager for good and is counted in `stats`. The graphs share
one memory pool (what the steps allocate outside the plan: SDPA outputs, small index lists),
measured as `pool_bytes`. Eligible: CUDA, no budget guard (the guard's transient pool and the
graphs' pool do not compose yet), no offload, no sequence parallelism, no block-sparse layout
estimation, a device-tier store, no probe, a reducer that draws no random numbers.

The backend is an interface (CudaGraphs, or a fake for the CPU tests), so the bookkeeping
(keys, padding, capture on the second run, fallback, LRU) is tested without a GPU."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..models.step import Step

MAX_GRAPHS = 64   # captured steps kept (LRU); each holds no activation memory of its own


class CudaGraphs:
    """torch.cuda.CUDAGraph capture and replay on one device, one shared memory pool."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], dict]):
        """(graph, outputs of fn captured) — fn's kernels recorded, not run to completion. A
        capture that fails is unwound (below) and its error re-raised."""
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
                outs = fn()
        except Exception:
            self._unwind(g)
            raise
        return g, outs

    def _unwind(self, g) -> None:
        """After a failed capture: end a stream capture still running and the allocator's
        routing into the pool, then take a fresh pool. PyTorch (<= 2.13, pytorch#190308) leaves
        both set when an error interrupts a capture before its end, and every later capture then
        fails with "beginAllocateToPool: already recording to mempool_id" (seen on the H200:
        bench/results/gpu/everyday/gpu_tests_b8ea6f4.log)."""
        if torch.cuda.is_current_stream_capturing():
            try:
                g.capture_end()
            except Exception:  # noqa: BLE001  (the capture is abandoned either way)
                pass
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end is not None:
            try:
                end(self.device.index if self.device.index is not None else torch.cuda.current_device(), self.pool)
            except Exception:  # noqa: BLE001  (routing already ended)
                pass
        self.pool = torch.cuda.graph_pool_handle()

    def replay(self, graph) -> None:
        graph.replay()

    def pool_bytes(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))


@dataclass
class Captured:
    """One captured step: its graph, the input tensors it reads (rewritten before each replay)
    and the output tensors it writes."""
    graph: object
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    replays: int = 0


@dataclass
class GraphStats:
    """Counters of a StepGraphs (for --json and the benchmarks)."""
    captures: int = 0
    replays: int = 0
    eager: int = 0
    capture_ms: float = 0.0
    pool_bytes: int = 0
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"captures": self.captures, "replays": self.replays, "eager": self.eager,
                "capture_ms": self.capture_ms, "pool_bytes": self.pool_bytes, "failures": list(self.failures)}


def eligible(step: Step, prepared, reducer_random: bool) -> str | None:
    """Why this step cannot be captured (None: it can)."""
    if step.shard is not None:
        return "sequence parallel"
    if step.offload is not None:
        return "offload"
    if step.sparse is not None:
        return "block-sparse"
    if step.rows_uncond is not None:
        return "cfg"
    if reducer_random:
        return "random draws"
    if getattr(step.reducer, "uniform", True) is False:
        return "stacked reducers of different row math"
    cache = step.cache
    if cache is not None and cache.store is not None and cache.store.layout.hot < cache.store.layout.num_layers:
        return "host-tier store"
    if step.num_masked == 0:
        return "no rows"
    return None


def reducer_draws(reducer) -> bool:
    """Whether a reducer draws random numbers (they would be frozen into the graph)."""
    if reducer is None:
        return False
    g = getattr(reducer, "g", None)
    return bool(g is not None and g.temperature > 0)


def pad_rows(rows: torch.Tensor, m: int) -> torch.Tensor:
    """rows [M] padded to m by repeating the last (their outputs are dropped)."""
    if rows.shape[0] >= m:
        return rows
    return torch.cat([rows, rows[-1:].expand(m - rows.shape[0])])


def step_inputs(step: Step) -> dict[str, torch.Tensor]:
    """The tensors a captured step reads that change between its replays: the canvas ids, the
    positions, the masked rows and, for a batched block step, where its sequences lie in their
    K/V buffer (models/batched_attention.BatchIndex)."""
    out = {"ids": step.ids, "positions": step.positions, "rows": step.rows}
    if step.cache is not None and hasattr(step.cache, "graph_inputs"):
        out.update(step.cache.graph_inputs())
    return out


POISONED = "already recording"   # a capture error after which the allocator stays in capture mode


class StepGraphs:
    """Captured steps of one engine, keyed by everything the kernels' addresses and shapes
    depend on. backend: CudaGraphs (default on CUDA) or a fake."""

    def __init__(self, backend, max_graphs: int = MAX_GRAPHS, allowed: Callable[[], bool] | None = None):
        self.backend, self.max_graphs = backend, max_graphs
        self.allowed = allowed or (lambda: True)   # e.g. no budget guard (module docstring)
        self.graphs: OrderedDict = OrderedDict()
        self.seen: set = set()
        self.failed: set = set()
        self.stats = GraphStats()

    def key(self, step: Step, prepared, arena_ptr: int) -> tuple:
        cache = step.cache
        where = () if cache is None else (*cache.where(), cache.store.address() if cache.store is not None else 0)
        return (prepared.key, tuple(step.ids.shape), arena_ptr, where)

    def run(self, step: Step, prepared, launch: Callable[[Step], dict], arena_ptr: int) -> dict | None:
        """The step's outputs ({name: [M, ...]}, copies), or None when it must run eager (the
        caller runs it). launch(step) runs the program on the arena and returns its outputs."""
        key = self.key(step, prepared, arena_ptr)
        shape_key = key[:2]
        if shape_key in self.failed:
            return None
        m, cap = step.num_masked, prepared.step.num_masked
        padded = step.with_(rows=pad_rows(step.rows, cap)) if cap > m else step
        got = self.graphs.get(key)
        if got is None:
            if shape_key not in self.seen:   # first run of the shape: eager (kernel loading, autotuning)
                self.seen.add(shape_key)
                self.stats.eager += 1
                return None
            got = self._capture(key, shape_key, padded, launch)
            if got is None:
                return None
        self.graphs.move_to_end(key)
        for name, t in step_inputs(padded).items():
            got.inputs[name].copy_(t)
        self.backend.replay(got.graph)
        got.replays += 1
        self.stats.replays += 1
        return {k: v[:m].clone() for k, v in got.outputs.items()}

    def _capture(self, key, shape_key, step: Step, launch) -> Captured | None:
        inputs = {k: t.clone() for k, t in step_inputs(step).items()}
        static = step.with_(ids=inputs["ids"], positions=inputs["positions"], rows=inputs["rows"])
        if step.cache is not None and hasattr(step.cache, "graph_inputs"):
            static = static.with_(cache=step.cache.with_graph_inputs(inputs))
        t0, before = time.perf_counter(), self.backend.pool_bytes()
        try:
            graph, outs = self.backend.capture(lambda: launch(static))
        except Exception as e:   # an op that cannot be captured: this shape stays eager
            self.failed.add(shape_key)
            self.stats.failures.append(f"{type(e).__name__}: {str(e)[:160]}")
            if POISONED in str(e):   # the allocator could not be unwound: no more captures
                self.allowed = lambda: False
            return None
        self.stats.capture_ms += (time.perf_counter() - t0) * 1e3
        self.stats.captures += 1
        got = Captured(graph, inputs, outs)
        self.graphs[key] = got
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        self.stats.pool_bytes += max(0, self.backend.pool_bytes() - before)   # what the capture kept
        return got

    def clear(self) -> None:
        """Drop every graph (an engine that is closed)."""
        self.graphs.clear()
        self.seen.clear()
        self.failed.clear()
