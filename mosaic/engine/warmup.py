"""Engine start under a budget on a GPU: run the step program once at a small size and measure
what it leaves on the device, instead of guessing.

A first step creates what then stays for the process's life: cuBLAS and cuBLASLt handles and
their workspaces (PyTorch keeps one per handle and stream), the kernels' code loaded lazily by
the driver, Triton's compiled kernels and their autotuning (the fused logits kernel tunes once
per hidden size; tuning allocates Triton's 256 MiB L2-flush buffer from PyTorch's allocator,
which is what raised a 20 GiB request by 256 MiB late in its step in the first GPU soak). The warm-up runs
one planned step at `length` tokens (half prompt, half masked) and one at 64 tokens for each
sampler option that reaches a different kernel, then reads the driver's counter (cudaMemGetInfo)
with PyTorch's cache emptied. The workspace is what the process then holds beyond the weights,
the context measured at engine start and the arena's pages: PyTorch's share = memory_reserved
- the resident weights (the BLAS workspaces, the weights' segment rounding, any tensor alive),
the driver's share = the rest. Measured as a level, not as a before/after difference: in the
GPU soak every engine after the first in a process measured a difference of 0 (the handles and
their 32 MiB of cuBLAS workspace in PyTorch's pool already existed) and so charged nothing for
them; the driver's part had moved into the next engine's context, PyTorch's part into nothing.

The engine's DeviceMemory hands itself and a function that runs one planned request; this module
knows nothing else of the engine."""

from __future__ import annotations

import gc
import time
import warnings

import torch

from ..errors import MosaicError
from ..memory.transient import DeviceGuard, TorchCudaBackend
from ..models.families import family_of


class CudaCounters:
    """The driver's counter and PyTorch's on one CUDA device (a fake replaces it in tests)."""

    def __init__(self, dev):
        self.dev = dev

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.dev)
        return int(total - free)

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.dev))

    def settle(self) -> None:
        torch.cuda.synchronize(self.dev)
        gc.collect()
        torch.cuda.empty_cache()

    def touch(self, dtype) -> None:
        touch_libraries(self.dev, dtype)


def _arena_split(arena) -> tuple[int, int]:
    """(pages outside PyTorch, bytes inside PyTorch's allocator) the arena holds now."""
    if arena.kind == "vmm":
        return arena.physical_bytes, 0
    return 0, arena.mapped_bytes


def phantom_weight_bytes(model) -> int:
    """Weight bytes charged but not on the device: a depth-truncated bench model charged its
    full depth (Model.charged_layers) holds only its own layers."""
    charged = getattr(model, "charged_layers", None)
    if not charged or not model.layers:
        return 0
    per_layer = sum(w.numel() * w.element_size() for w in model.layers[0].values())
    return per_layer * max(0, charged - len(model.layers))


def resident_weight_bytes(model) -> int:
    """Weight bytes the device holds (PyTorch's allocator): the layers only while they are not
    offloaded to pinned host memory (runtime/placement.py sets model.packed_layers then)."""
    if getattr(model, "packed_layers", None) is not None:
        return model.weight_bytes(layers=False)
    return model.weight_bytes() - phantom_weight_bytes(model)


def kv_pool_bytes(memory) -> int:
    """Bytes an engine's paged K/V pool holds now (under a budget its buffers stay, idle, between
    requests: memory/kv_pool.py); 0 for an engine without one."""
    pool = getattr(memory, "kv_pool", None)
    return pool.capacity_bytes if pool is not None else 0


def make_guard(model, budget, rep: dict, backend=None, stream=None, pool: str = "auto") -> DeviceGuard:
    """The engine's budget guard after a warm-up report `rep`: outside PyTorch and the arena sit
    the context, the driver's share of the workspace, the late-load allowance and the weights
    charged but not resident (so that the cap binds a depth-truncated model at what admission
    charged it too; without them the soak's cap was ~12 GiB loose and never bound). stream: the
    captured steps' stream, where graph mode runs every planned step (memory/transient.py);
    pool: the engine's transient_pool (TorchCudaBackend's strategy; InputError where torch lacks it)."""
    b = budget
    outside = b.context_bytes + rep["workspace_driver_bytes"] + b.late_bytes + phantom_weight_bytes(model)
    return DeviceGuard(backend if backend is not None else TorchCudaBackend(model.device, pool, stream=stream),
                       b.budget_bytes, outside)


def touch_thread(dev, dtype, streams=(), counters=None) -> tuple[int, int]:
    """A thread's first products on `dev` (its own cuBLAS handle, a workspace per stream:
    the default one and `streams`), made outside any pool and cap; returns what they took
    (PyTorch's bytes, the driver's bytes). A server's engine thread is not the one that warmed
    the engine up: its handles and workspaces would otherwise be born inside a step's pool."""
    c = counters or CudaCounters(dev)
    torch.cuda.synchronize(dev)
    used0, torch0 = c.used(), c.reserved()
    touch_libraries(dev, dtype)
    for s in streams:
        with torch.cuda.stream(s):
            touch_libraries(dev, dtype)
    torch.cuda.synchronize(dev)
    used1, torch1 = c.used(), c.reserved()
    return max(0, torch1 - torch0), max(0, (used1 - used0) - (torch1 - torch0))


def touch_libraries(dev, dtype) -> None:
    """Create the BLAS handles and workspaces in PyTorch's default pool: the first matmul
    allocates them, and they must never be born inside a step's transient pool."""
    a = torch.ones(64, 64, device=dev, dtype=dtype)
    torch.mm(a, a)
    torch.addmm(a[0], a, a)
    torch.bmm(a[None], a[None])
    torch.cuda.synchronize(dev)


def warm_up(memory, run_request, sampler, length: int = 4096, counters=None, graphs=None) -> dict:
    """Run the warm-up requests (run_request(ids, gen_len, options): one planned request, no
    cap set yet) on the engine whose DeviceMemory is `memory`, and return the measured bytes:
    workspace_bytes (driver counter, arena excluded), workspace_torch_bytes (PyTorch's share),
    and what ran. A request the initial budget refuses is halved, then skipped; every skipped
    option case is listed. graphs: the engine's StepGraphs: one 64-token step is captured and
    replayed to measure what a graph's executable takes per op (graph_bytes_per_op: admission
    charges graphs with it, policy/graph_charge.py), then every graph is dropped before the
    workspace is measured."""
    model, arena = memory.model, memory.arena
    c = counters or CudaCounters(model.device)
    t0 = time.perf_counter()
    c.settle()
    used0 = c.used()
    out0, in0 = _arena_split(arena)
    c.touch(model.dtype)
    has_blocks = "block_length" in sampler.options
    ran, skipped = [], []

    cfg = model.cfg
    span = max(2, min(cfg.vocab, 1000) // 2)

    def run(n, opts):
        gen = n // 2
        extra = {"block_length": gen} if has_blocks else {}
        ids = [1 + i % span for i in range(n - gen)]       # in the vocabulary, clear of the mask id
        ids = [1 if t == cfg.mask_id else t for t in ids]
        with warnings.catch_warnings():     # a warm-up longer than the trained length says nothing
            warnings.simplefilter("ignore")
            run_request(ids, gen, {**extra, **opts})

    n = length
    while n >= 64:
        try:
            run(n, {})
            ran.append({"tokens": n})
            break
        except MosaicError as e:
            skipped.append({"tokens": n, "error": str(e)[:200]})
            n //= 2
    for opts in family_of(cfg).warmup_cases:   # options that reach another kernel (the family's record)
        allowed = set(sampler.options) | {"temperature"}
        if not set(opts) <= allowed:
            continue
        try:
            run(64, opts)
            ran.append({"tokens": 64, **opts})
        except MosaicError as e:
            skipped.append({"tokens": 64, **opts, "error": str(e)[:200]})
    graph_bytes_per_op = _graph_probe(graphs, run, ran, skipped)
    pool = getattr(memory, "kv_pool", None)
    if pool is not None:      # the warm-up's idle K/V buffers are no workspace (kept idle: memory/kv_pool.py)
        pool.trim()
    c.settle()
    used1, torch1 = c.used(), c.reserved()
    out1, in1 = _arena_split(arena)
    # levels, not differences (module docstring); the arena is charged per step. What other
    # engines or tensors of the process held at start is charged as context already.
    others = getattr(memory, "others_bytes", 0)
    torch_part = max(0, torch1 - in1 - resident_weight_bytes(model) - others)
    driver_part = max(0, used1 - out1 - torch1 - (memory.budget.context_bytes - others))
    delta = max(0, (used1 - out1 - in1) - (used0 - out0 - in0))
    return {"workspace_bytes": torch_part + driver_part, "workspace_torch_bytes": torch_part,
            "workspace_driver_bytes": driver_part, "workspace_delta_bytes": delta, "ran": ran,
            "skipped": skipped, "graph_bytes_per_op": graph_bytes_per_op, "seconds": time.perf_counter() - t0}


def _graph_probe(graphs, run, ran: list, skipped: list) -> float:
    """Capture one 64-token step (the same request twice: eager, then captured and replayed)
    and return the executable's bytes per op it measured; every graph is dropped after."""
    if graphs is None:
        return 0.0
    try:
        run(64, {})
        run(64, {})
        ran.append({"tokens": 64, "graph_probe": graphs.stats.captures})
    except MosaicError as e:
        skipped.append({"tokens": 64, "graph_probe": 0, "error": str(e)[:200]})
    graphs.drop_graphs()
    return graphs.bytes_per_op
