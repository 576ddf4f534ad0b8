"""CUDA graphs for runtime/graphs.py: capture, replay, the graphs' random stream and what a
graph costs on the device. The fake of the CPU tests (tests/runtime/fake_graphs.py) implements
the same members.

Streams and pools. Without a budget a capture uses this backend's own private pool on its own
stream, as torch.cuda.graph does. Under a budget the guard's transient pool (memory/transient.py,
graph mode) is the graphs' pool and this backend's stream is where every planned step runs, eager
or replayed, so that eager steps and captures carve their transients from the one segment the
guard reserved (the caching allocator serves a stream only from its own segments).

The random stream. A captured step draws from `generator`, this backend's own CUDA generator,
registered with every graph (torch.cuda.CUDAGraph.register_generator_state): a replay reads the
seed and Philox offset the generator holds when it starts and advances it by the graph's whole
increment. Before a replay `load` sets the generator to the request's stream (its generator, or
torch's default one: the seed and offset, host values), after it `advance` moves the request's
stream on by what the eager step would have drawn. Measured on the H200 (bench/results/gpu/
session7/design_probe_29bb6f0.json, "rng"): replays continue the eager stream exactly.

Padded rows. A captured step computes its largest masked count; the eager step draws for its real
rows only. torch's Philox kernels (ATen's distribution_nullary_kernel: element i of a call is
drawn by thread i mod (block x grid) at round i div (block x grid x unroll), and the grid is
ceil(n / 256) blocks capped at SMs x 2048 / 256) give element i the same value in every call of
at least i + 1 elements from one seed and offset, so the real rows' draws are the eager ones;
only the offset a call consumes, `philox_increment(n)`, depends on n, and `advance` charges the
real one. `check_increments` measures it against this formula once per process; a mismatch turns
captured draws off (runtime/graphs.py counts why)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..memory.capture_guard import capturing_alone

BLOCK = 256                # distribution kernels' block size (ATen's block_size_bound)


def unroll_of(dtype: torch.dtype) -> int:
    """Values a Philox round yields per thread: curand_uniform2_double for float64, 4 otherwise."""
    return 2 if dtype == torch.float64 else 4


def philox_increment(numel: int, dtype: torch.dtype, sms: int, threads_per_sm: int = 2048) -> int:
    """Philox offset one torch random call of `numel` elements consumes on CUDA (ATen's
    calc_execution_policy: ((n - 1) / (block x grid x unroll) + 1) x 4, grid = ceil(n / 256)
    capped at sms x threads_per_sm / 256)."""
    if numel <= 0:
        return 0
    grid = min(-(-numel // BLOCK), sms * (threads_per_sm // BLOCK))
    return ((numel - 1) // (BLOCK * grid * unroll_of(dtype)) + 1) * 4


class CudaGraphs:
    """torch.cuda.CUDAGraph capture and replay on one device (module docstring)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self.device)
        self.generator = torch.Generator(device=self.device)
        props = torch.cuda.get_device_properties(self.device)
        self.sms = props.multi_processor_count
        self.threads_per_sm = getattr(props, "max_threads_per_multi_processor", 2048)
        # a graph that is never captured keeps both generators registered for the engine's life:
        # each registration allocates the state's two 8-byte device tensors, and they are then
        # made once, at engine start, in PyTorch's default pool (measured with the workspace),
        # not at a capture under the budget's cap
        self._registry = torch.cuda.CUDAGraph()
        self.can_draw = hasattr(self._registry, "register_generator_state")
        if self.can_draw:
            self._registry.register_generator_state(self.generator)
            self._registry.register_generator_state(torch.cuda.default_generators[self.index])
        with torch.cuda.stream(self.stream):     # cuBLAS's workspace of this stream, outside any pool
            a = torch.ones(64, 64, device=self.device, dtype=torch.bfloat16)
            torch.mm(a, a)
        self.stream.synchronize()
        self.draw_problem = self.check_increments() if self.can_draw else \
            "this torch cannot register a generator with a graph"

    # -- capture and replay
    def capture(self, fn: Callable[[], dict], pool=None, draws: bool = False):
        """(graph, outputs of fn captured): fn's kernels recorded on `pool` = (pool id, stream)
        (None: this backend's own). draws: fn draws from self.generator. The capture runs alone
        (memory/capture_guard.py). A capture that fails is unwound (the caller's stream made
        current again) and its error re-raised."""
        pool_id, stream = pool if pool is not None else (self.pool, self.stream)
        with capturing_alone():     # no other thread's device-wide call, no finalizer, inside it
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            if draws:
                g.register_generator_state(self.generator)
            caller = torch.cuda.current_stream(self.device)
            try:
                with torch.cuda.graph(g, pool=pool_id, stream=stream, capture_error_mode="thread_local"):
                    outs = fn()
            except Exception:
                self._unwind(g, pool_id)
                torch.cuda.set_stream(caller)    # torch.cuda.graph's exit skips it when capture_end raises
                raise
        return g, outs

    def _unwind(self, g, pool_id) -> None:
        """After a failed capture: end a stream capture still running and the allocator's routing
        into the pool. PyTorch (<= 2.13, pytorch#190308) leaves both set when an error interrupts
        a capture before its end, and every later capture then fails with "beginAllocateToPool:
        already recording to mempool_id" (seen on the H200: bench/results/gpu/everyday/
        gpu_tests_b8ea6f4.log). Our own pool is replaced; a guard's is rebuilt by its owner."""
        if torch.cuda.is_current_stream_capturing():
            try:
                g.capture_end()
            except Exception:  # noqa: BLE001  (the capture is abandoned either way)
                pass
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end is not None:
            try:
                end(self.index, pool_id)
            except Exception:  # noqa: BLE001  (routing already ended)
                pass
        if pool_id == self.pool:
            self.pool = torch.cuda.graph_pool_handle()

    def replay(self, graph) -> None:
        graph.replay()

    # -- the random stream
    def source(self, generator):
        """The generator a step draws from: its own, or torch's default one of the device."""
        return generator if generator is not None else torch.cuda.default_generators[self.index]

    def load(self, generator):
        """Point self.generator at `generator`'s stream (None: the default one) before a replay;
        returns the token `advance` and `restore` take."""
        src = self.source(generator)
        seed, offset = src.initial_seed(), src.get_offset()
        self.generator.manual_seed(seed)
        self.generator.set_offset(offset)
        return src, offset

    def advance(self, token, real: list, padded: list) -> None:
        """After a replay: the request's stream moves on by the graph's draws, less what its
        padded calls drew beyond the real rows' calls ([(kind, numel, dtype)] each)."""
        src, offset = token
        used = self.generator.get_offset() - offset
        src.set_offset(offset + used + self._increments(real) - self._increments(padded))

    def restore(self, token) -> None:
        """The request's stream as it was before the replay (the step is run again eagerly)."""
        src, offset = token
        src.set_offset(offset)

    def _increments(self, calls: list) -> int:
        return sum(philox_increment(n, dt, self.sms, self.threads_per_sm) for _, n, dt in calls)

    def check_increments(self) -> str | None:
        """None when philox_increment is what this torch consumes (measured on small tensors at
        the formula's boundaries), else why captured draws stay off."""
        g = torch.Generator(device=self.device).manual_seed(0)
        rounds = BLOCK * self.sms * (self.threads_per_sm // BLOCK)
        for dtype in (torch.float32, torch.float64):
            for n in (1, 4097, rounds * unroll_of(dtype), rounds * unroll_of(dtype) + 1):
                t = torch.empty(n, dtype=dtype, device=self.device)
                before = g.get_offset()
                t.exponential_(1, generator=g)
                got, want = g.get_offset() - before, philox_increment(n, dtype, self.sms, self.threads_per_sm)
                if got != want:
                    return f"torch's Philox offset for {n} {dtype} draws is {got}, not {want}"
        return None

    # -- what a graph holds
    def measure(self) -> tuple[int, int]:
        """(bytes the driver counts on the device, bytes PyTorch reserves), after the device
        finished: a graph's executable is the first's growth less the second's."""
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total - free), int(torch.cuda.memory_reserved(self.device))

    def on_stream(self):
        """The context captures and graph-mode steps run in (runtime/graphs.py)."""
        return torch.cuda.stream(self.stream)
