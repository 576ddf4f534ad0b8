"""Timing and memory measurement shared by the suites.

Time: synchronised wall clock (`timed`, for whole steps of tens of ms and more), CUDA events
(`cuda_ms`, for kernels and copies), triton's do_bench medians (`bench_ms`). Memory: the driver's
counter through mosaic.memory.device_meter (`meter`: NVML by the device's NVML index, else
cudaMemGetInfo — the one way the suites find a GPU's counter), cudaMemGetInfo (`device_used`),
and PyTorch's counters plus the arena's pages (`counters_peak`)."""

from __future__ import annotations

import gc
import os
import statistics
import time

import torch

GiB, MiB = 2**30, 2**20


def sync(device=None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize(device)


def free(device=None) -> None:
    """Drop dead tensors and hand PyTorch's cached blocks back, so the next peak starts clean."""
    gc.collect()
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def reset_peaks() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def timed(fn, repeat: int = 3, warmup: int = 1) -> list[float]:
    """Wall-clock ms of each of `repeat` calls of fn() after `warmup` calls, synchronised."""
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def median(xs):
    return statistics.median(xs) if xs else None


def cuda_ms(fn, reps: int = 10) -> float:
    """Mean ms of `reps` back-to-back calls of fn() by CUDA events, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def bench_ms(fn, warmup: int, rep: int) -> float:
    """triton.testing.do_bench's median ms (warmup and rep in ms of device time)."""
    import triton
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_ms(fn, reps: int = 20, timer=None) -> float:
    """ms per call of fn() replayed from one CUDA graph of `reps` calls (launch gaps removed),
    after two warm calls on a side stream. timer(replay) -> ms of one replay: cuda_ms's mean of
    10 (default) or e.g. bench_ms's median."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return (timer or (lambda f: cuda_ms(f, 10)))(g.replay) / reps


def canvas(model, n_tokens: int, n_masked: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """A canvas [batch, n_tokens] of int64 ids: seeded random prompt ids, the last n_masked
    positions masked; on the model's device."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    x = torch.randint(0, min(cfg.vocab, cfg.mask_id) - 1, (batch, n_tokens), generator=g)
    x[:, n_tokens - n_masked:] = cfg.mask_id
    return x.to(model.device)


# -- the device's memory
def device_used(device=None) -> int:
    """Bytes in use on the device by every process (cudaMemGetInfo: total - free)."""
    free_b, total = torch.cuda.mem_get_info(device)
    return total - free_b


def process_rss() -> int:
    """This process's resident bytes (what the CPU dry runs sample instead of a device)."""
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def meter(device=None, mode: str = "auto", interval_s: float = 0.002, baseline: bool = False):
    """A mosaic.memory.device_meter.DeviceMeter on `device`'s driver counter: NVML at the device's
    NVML index (NVML ignores CUDA_VISIBLE_DEVICES: device_meter.nvml_index maps it), else
    cudaMemGetInfo. mode 'auto': this process's bytes where NVML reports them, else the device's
    used bytes minus the baseline; 'device': the device's used bytes (every process).
    baseline=True reads the baseline now (call it before this process creates its CUDA context).
    Start it with `with meter(...) as m:` (the sampling thread) and read `m.peak_bytes`, or open
    windows: `with m.window() as w:` (w.peak_bytes)."""
    from mosaic.memory.device_meter import DeviceMeter, default_driver
    if device is not None and torch.device(device).index is not None:
        ordinal = torch.device(device).index
    else:   # asking for the current device would initialise CUDA before a pre-context baseline
        ordinal = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    m = DeviceMeter(default_driver(ordinal), interval_s=interval_s, mode=mode)
    if baseline:
        m.set_baseline()
    return m


def meter_source(m) -> str:
    """'nvml' or 'cudaMemGetInfo': which counter a meter reads."""
    return "nvml" if type(m.driver).__name__ == "NvmlDriver" else "cudaMemGetInfo"


class Sampler:
    """Max of `read()` (bytes) sampled every `period` s on a thread while the block runs; read
    defaults to cudaMemGetInfo's used bytes (every process), or the process RSS off a GPU."""

    def __init__(self, period: float = 0.005, read=None):
        import threading
        self.period, self.max_bytes, self.samples = period, 0, 0
        self.read = read or (device_used if torch.cuda.is_available() else process_rss)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        while not self._stop.is_set():
            self.max_bytes = max(self.max_bytes, self.read())
            self.samples += 1
            time.sleep(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)


def expandable_env() -> dict:
    """The environment of a child process on expandable_segments (fixed at process start) that
    leaves this process's device usage out of its own counters (MOSAIC_BENCH_OTHER_BYTES)."""
    return dict(os.environ, PYTORCH_ALLOC_CONF="expandable_segments:True",
                MOSAIC_BENCH_OTHER_BYTES=str(device_used()))


def other_bytes() -> int:
    """A parent process's device usage, handed to a child by expandable_env()."""
    return int(os.environ.get("MOSAIC_BENCH_OTHER_BYTES", "0"))
