"""The device's own counter: a background sampler of this process's device memory.

Mosaic's budget is a promise about what the driver sees, not about PyTorch's counters, so the
benchmarks and GPU tests read the driver: NVML's per-process used memory where the driver reports
it for this process (nvmlDeviceGetComputeRunningProcesses; in a container the PIDs NVML sees are
the host's, so there it usually does not), else the device's used memory minus a baseline taken
before this process created its CUDA context (on the project's H200: 0.60 GiB held by the driver
with no context). The last resort is cudaMemGetInfo through PyTorch (device-wide).

A thread polls every `interval_s` (2 ms by default). Python threads share the GIL, whose switch
interval is 5 ms, so a sample can come up to ~7 ms late while the main thread runs Python; a
caching allocator's segments stay reserved after their tensors die, so device-memory rises last
far longer than that (the first GPU soak's rise lasted ~15% of a 75 s step). Windows (`window()`) read the
counter synchronously at their start and end too, so no window misses its end points.

The driver sits behind a three-method interface (device_used, process_used, total), so the
sampler, the baseline and the windows are tested on the CPU with a scripted fake."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field


class NvmlDriver:
    """NVML through pynvml / nvidia-ml-py when installed, else through ctypes on the driver's own
    libnvidia-ml.so.1 (device memory only: the per-process query's struct layout changes across
    driver versions, so only pynvml is trusted with it). index: NVML's device index (NVML ignores
    CUDA_VISIBLE_DEVICES; `nvml_index` maps a CUDA ordinal). Raises RuntimeError without NVML."""

    def __init__(self, index: int = 0):
        self.index = index
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nv = pynvml
            self._h = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.kind = "pynvml"
        except ImportError:
            self._nv = None
            self._lib = _load_nvml()
            self._h = ctypes.c_void_p()
            _check(self._lib.nvmlInit_v2())
            _check(self._lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(self._h)))
            self.kind = "ctypes"

    def _memory(self):
        if self._nv is not None:
            m = self._nv.nvmlDeviceGetMemoryInfo(self._h)
            return int(m.total), int(m.used)
        m = _NvmlMemory()
        _check(self._lib.nvmlDeviceGetMemoryInfo(self._h, ctypes.byref(m)))
        return int(m.total), int(m.used)

    def device_used(self) -> int:
        return self._memory()[1]

    def total(self) -> int:
        return self._memory()[0]

    def process_used(self, pid: int) -> int | None:
        """This PID's used device memory, or None where NVML does not report it."""
        if self._nv is None:
            return None
        nv = self._nv
        try:
            procs = nv.nvmlDeviceGetComputeRunningProcesses(self._h)
        except nv.NVMLError:
            return None
        for p in procs:
            if p.pid == pid:
                used = p.usedGpuMemory
                return None if used is None or used >= 2**63 else int(used)  # NOT_AVAILABLE
        return None


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _load_nvml():
    for name in ("libnvidia-ml.so.1", "libnvidia-ml.so", "nvml.dll"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("NVML not found (no pynvml / nvidia-ml-py and no libnvidia-ml.so.1)")


def _check(code: int) -> None:
    if code != 0:
        raise RuntimeError(f"NVML call failed with code {code}")


class CudaRuntimeDriver:
    """cudaMemGetInfo through PyTorch: device-wide used memory, no per-process figure. Creates
    the CUDA context on first use, so it cannot take a pre-context baseline."""

    def __init__(self, device=None):
        import torch
        self.torch, self.device = torch, device

    def device_used(self) -> int:
        free, total = self.torch.cuda.mem_get_info(self.device)
        return int(total - free)

    def total(self) -> int:
        return int(self.torch.cuda.mem_get_info(self.device)[1])

    def process_used(self, pid: int) -> int | None:
        return None


def nvml_index(cuda_ordinal: int = 0) -> int:
    """NVML's index of CUDA device `cuda_ordinal` under CUDA_VISIBLE_DEVICES (numeric lists only;
    CUDA's default order matches NVML's PCI order on hosts of identical GPUs such as the H200s)."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not vis:
        return cuda_ordinal
    parts = [p.strip() for p in vis.split(",") if p.strip()]
    if cuda_ordinal < len(parts) and parts[cuda_ordinal].isdigit():
        return int(parts[cuda_ordinal])
    return cuda_ordinal


def default_driver(cuda_ordinal: int = 0):
    """NVML when it loads, else cudaMemGetInfo."""
    try:
        return NvmlDriver(nvml_index(cuda_ordinal))
    except Exception:  # noqa: BLE001  (no NVML on this host: any failure means the fallback)
        return CudaRuntimeDriver(f"cuda:{cuda_ordinal}")


@dataclass
class Window:
    """The process's device bytes over one window: at its start, end and highest sample."""
    start_bytes: int = 0
    end_bytes: int = 0
    peak_bytes: int = 0
    peak_at_s: float = 0.0        # seconds after the window opened when the peak was read
    samples: int = 0
    seconds: float = 0.0
    mode: str = ""
    _t0: float = field(default=0.0, repr=False)


class DeviceMeter:
    """Samples this process's device memory on a thread.

    driver: NvmlDriver / CudaRuntimeDriver / a fake with device_used(), process_used(pid),
    total(); mode: 'auto' (process-level when the driver reports this PID, else device used minus
    the baseline), 'process' or 'device'. Use: `meter.set_baseline()` before anything creates the
    CUDA context, `meter.start()`, then `with meter.window() as w: ...` per request (w.peak_bytes
    after the block), `meter.stop()`. keep_timeline: (seconds, bytes) samples, the last 200k."""

    def __init__(self, driver=None, interval_s: float = 0.002, pid: int | None = None,
                 mode: str = "auto", clock=time.perf_counter, keep_timeline: bool = False):
        if mode not in ("auto", "process", "device"):
            raise ValueError(f"mode {mode!r}: use 'auto', 'process' or 'device'")
        self.driver = driver if driver is not None else default_driver()
        self.interval_s, self.pid = interval_s, os.getpid() if pid is None else pid
        self.clock = clock
        self.baseline_bytes: int | None = None
        self._mode = mode
        self._lock = threading.Lock()
        self._windows: list[Window] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.peak_bytes = 0           # over the meter's whole life
        self.samples = 0
        self.timeline: deque | None = deque(maxlen=200_000) if keep_timeline else None
        self._t_start = clock()

    # -- reading
    @property
    def mode(self) -> str:
        """'process' or 'device' (decided on the first read in 'auto')."""
        if self._mode == "auto":
            self._mode = "process" if self.driver.process_used(self.pid) is not None else "device"
        return self._mode

    def set_baseline(self) -> int:
        """The device's used bytes now: call before this process creates a CUDA context."""
        self.baseline_bytes = int(self.driver.device_used())
        return self.baseline_bytes

    def read(self) -> int:
        """This process's device bytes now."""
        if self.mode == "process":
            used = self.driver.process_used(self.pid)
            if used is not None:
                return int(used)
        return int(self.driver.device_used()) - (self.baseline_bytes or 0)

    def sample(self) -> int:
        """Read once and fold the value into the meter's and every open window's peak."""
        v = self.read()
        now = self.clock()
        with self._lock:
            self.samples += 1
            self.peak_bytes = max(self.peak_bytes, v)
            for w in self._windows:
                w.samples += 1
                if v > w.peak_bytes:
                    w.peak_bytes, w.peak_at_s = v, now - w._t0
            if self.timeline is not None:
                self.timeline.append((now - self._t_start, v))
        return v

    # -- the thread
    def start(self) -> DeviceMeter:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="device-meter", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # noqa: BLE001  (a failed read must not kill the run it measures)
                pass
            self._stop.wait(self.interval_s)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- windows
    @contextmanager
    def window(self):
        """Yields a Window filled while the block runs: start, end and peak bytes (synchronous
        reads at both ends plus every thread sample in between)."""
        w = Window(mode=self.mode, _t0=self.clock())
        w.start_bytes = w.peak_bytes = self.read()
        with self._lock:
            self._windows.append(w)
        try:
            yield w
        finally:
            end = self.sample()
            with self._lock:
                self._windows.remove(w)
            w.end_bytes, w.seconds = end, self.clock() - w._t0
