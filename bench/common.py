"""What every benchmark record carries: machine, GPU, versions, date, commit, config."""

from __future__ import annotations

import datetime
import platform
import subprocess
import sys
from pathlib import Path

import torch

# every bench script imports this module before mosaic: the repository's package, installed or not
# (the device machine runs a copy of the tree with nothing installed)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def git_commit() -> str:
    import os
    if os.environ.get("MOSAIC_COMMIT"):  # the device machine's copy has no .git
        return os.environ["MOSAIC_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record_header(config: dict) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": platform.node(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__,
        "triton": triton_version, "gpu": gpu,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "config": config,
    }


def sync(device=None):
    if torch.cuda.is_available():
        torch.cuda.synchronize(device)


def timed(fn, repeat: int = 3, warmup: int = 1) -> list[float]:
    """Wall-clock ms of fn() after warm-up, synchronised (fn is a whole step, tens of ms+)."""
    import time
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
    import statistics
    return statistics.median(xs) if xs else None


def device_used() -> int:
    """Bytes in use on the device by every process (the budget's ground truth)."""
    free, total = torch.cuda.mem_get_info()
    return total - free


def free():
    """Drop dead tensors and hand PyTorch's cached blocks back, so the next peak starts clean."""
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def expandable_env() -> dict:
    """The environment of a child process on expandable_segments (fixed at process start) that
    leaves this process's device usage out of its own counters."""
    import os
    return dict(os.environ, PYTORCH_ALLOC_CONF="expandable_segments:True",
                MOSAIC_BENCH_OTHER_BYTES=str(device_used()))


def reset_peaks():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def canvas(model, n_tokens: int, n_masked: int, batch: int = 1, seed: int = 0):
    """A canvas of n_tokens: random prompt ids, the last n_masked positions masked."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    x = torch.randint(0, min(cfg.vocab, cfg.mask_id) - 1, (batch, n_tokens), generator=g)
    x[:, n_tokens - n_masked:] = cfg.mask_id
    return x.to(model.device)


def step_fns(engine, x, native: bool, probe=None):
    """One denoising step of the published sampler (native) or Mosaic's, on canvas x."""
    return lambda: engine.step(x, native=native, probe=probe)
