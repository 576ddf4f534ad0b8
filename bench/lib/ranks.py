"""What the multi-process suites (multi_gpu, tensor_parallel) share: the launch environment,
each rank's device and memory meter, and gathering a value from every rank."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from bench.lib.measure import meter
from mosaic.launch import SAFE_ENV
from mosaic.runtime import parallel


def start_rank(smoke: bool):
    """(rank, world, device, meter or None) of this process under torch.distributed.run, with
    Mosaic's launch environment and NCCL bounds set. smoke: the CPU (gloo, one thread); else the
    rank's GPU, its meter started before this process touches the GPU."""
    os.environ.update(SAFE_ENV)
    for k, v in parallel.NCCL_BOUNDS.items():
        os.environ.setdefault(k, v)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    dev = torch.device("cpu") if smoke else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    m = None
    if dev.type == "cuda":
        m = meter(dev, mode="auto", baseline=True)   # before this process touches the GPU
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)
    return rank, world, dev, m


def everyone(obj, dev) -> list:
    """Every rank's picklable obj, in rank order, on every rank."""
    out = []
    for r in range(dist.get_world_size()):
        box = [obj if r == dist.get_rank() else None]
        dist.broadcast_object_list(box, src=r, device=dev if dev.type == "cuda" else None)
        out.append(box[0])
    return out
