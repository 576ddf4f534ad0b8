"""Several processes for one command (`mosaic generate --gpus K`): one per GPU (NCCL) or, on a
CPU, K gloo processes, started here rather than by torchrun so that a refused or invalid request
ends as it does on one process: one `error:` line from rank 0 and exit code 2, with no launcher
report or traceback. The processes find each other through torch.distributed's env:// rendezvous
(MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, as torchrun sets them; a command run
under torchrun itself works the same)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from .runtime.parallel import NCCL_BOUNDS

# NVLink multicast stays off in every launch (a program that uses it can take a shared host's
# GPUs out of service)
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GRACE_S = 20.0    # after one process fails, the others get this long to end on their own


def free_port() -> int:
    """A TCP port free on this host now (the rendezvous binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(num: int, port: int) -> dict:
    env = dict(os.environ)
    env.update(SAFE_ENV)
    for k, v in NCCL_BOUNDS.items():
        env.setdefault(k, v)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(num),
               LOCAL_WORLD_SIZE=str(num))
    return env


def launch(argv: list[str], num: int) -> int:
    """Run `python -m mosaic *argv` as `num` processes; returns rank 0's exit code, or when rank 0
    succeeded the first failing rank's (1 for one ended by a signal)."""
    env = child_env(num, free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "mosaic", *argv],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(num)]
    try:
        codes = _wait(procs)
    except KeyboardInterrupt:
        _stop(procs)
        return 130
    codes = [c if c >= 0 else 1 for c in codes]
    return codes[0] or next((c for c in codes if c), 0)


def _wait(procs) -> list[int]:
    deadline = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes
        if deadline is None and any(c for c in codes if c is not None):
            deadline = time.monotonic() + GRACE_S   # a rank failed: peers may wait in a collective
        if deadline is not None and time.monotonic() > deadline:
            _stop(procs)
            return [p.wait() for p in procs]
        time.sleep(0.05)


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def rank() -> int:
    """This process's rank (0 alone)."""
    return int(os.environ.get("RANK", "0"))


def init_distributed() -> int:
    """Join the process group the launcher (or torchrun) set up; returns this process's rank
    (0 alone). NCCL on GPUs (one per process, by LOCAL_RANK), gloo on a CPU."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0
    os.environ.update(SAFE_ENV)
    for k, v in NCCL_BOUNDS.items():
        os.environ.setdefault(k, v)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank()


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
