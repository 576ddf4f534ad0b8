"""Byte accounting: what the process holds on the device besides the plan, and the budget view.

Charged on top of a step's plan (docs/MEMORY.md has the measurements behind each number):
  - the weights;
  - the CUDA context (measured on the device; 0.60 GiB on the project's H200 for planning on a
    CPU);
  - the workspace: cuBLAS/cuBLASLt workspaces, library handles, kernels loaded by a step, small
    persistent tensors. Measured at engine start by a warm-up step (driver counter before and
    after: mosaic/engine/warmup.py); FIXED_BYTES (a guess) where it was not measured;
  - an allowance for kernels first loaded after the warm-up (LATE_LOAD_BYTES);
  - the request's per-token tensors (canvas, masks, row lists, the sampler's candidates and
    confidences): INPUT_BYTES_PER_TOKEN, plus REQUEST_SLACK_BYTES for the caching allocator's
    segment rounding of them;
  - the step's out-of-plan transients (the template's external peak), which run from a pool
    reserved before the step (transient.py) at caching.pool_bytes(peak) + two small segments;
    with the arena's 2 MiB page rounding this is at most the peak + STEP_ROUNDING_BYTES.
Allocator rounding (the last three items' slack and LATE_LOAD_BYTES) is charged on CUDA only:
a CPU run's 'budget' models a GPU's for tests and has no caching allocator.

Policy (admission, capacity) sits above this and asks it for limits."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from ..config import parse_bytes
from ..errors import InputError, MemoryBudgetError, gib
from .caching import MIN_LARGE_ALLOC, POOL_SLACK, ROUND_LARGE, round_up
from .transient import SMALL_POOL_BYTES

MiB = 2**20
H200_CONTEXT_BYTES = int(0.60 * 2**30)  # BENCHMARKS.md: CUDA context on this project's H200
FIXED_BYTES = 320 * 2**20               # workspace guess where no warm-up measured it
# the workspace a warm-up measures on the H200 (`python -m bench soak` records it as
# workspace_bytes); `mosaic plan` charges it so that its L_max equals run-time admission's
H200_WORKSPACE_BYTES = FIXED_BYTES
# kernels whose module is first loaded after the warm-up (a cuBLAS tile shape only large
# products pick, a new sampler option's Triton variant): driver memory outside PyTorch
LATE_LOAD_BYTES = 32 * MiB
# the canvas and the sampler's per-token tensors on the device during a step: ids, positions,
# row list, full-length candidate ids and confidences, masks (int64 mostly; 59 B/token at most
# on the paths counted in docs/MEMORY.md)
INPUT_BYTES_PER_TOKEN = 64
# those tensors' segments: one 20 MiB large-buffer segment's worth (requests of 1-10 MiB) and
# six 2 MiB small-pool segments (requests up to 1 MiB) beyond their bytes
REQUEST_SLACK_BYTES = 32 * MiB
# per step: the arena's last 2 MiB page + the transient pool's rounding (a 10 MiB minimum,
# 2 MiB rounding, 512 B per block) + its two small-pool segments
STEP_ROUNDING_BYTES = ROUND_LARGE + MIN_LARGE_ALLOC + ROUND_LARGE + POOL_SLACK + SMALL_POOL_BYTES
# and under sequence parallelism, per masked slot of the step (all ranks'): the slots this rank
# owns and the local rows they read (int64 each) through the step, then every rank's results
# assembled in slot order (an int64 id, a 4-byte value) with the received ids and values, all of
# them when one rank owns every slot (runtime/parallel.py localize, gather_outs)
SHARD_BYTES_PER_SLOT = 48


def card_bytes(device: torch.device) -> int | None:
    """Total memory of the CUDA card (bytes), or None off a GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def device_total_bytes(device: torch.device) -> int | None:
    """All the memory of the device a budget bounds (bytes): the card's total on a GPU, the
    host's physical RAM on a CPU (MemTotal of /proc/meminfo, else sysconf); None where unknown."""
    if device.type == "cuda":
        return card_bytes(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_budget_total(budget_bytes: int | None, device: torch.device) -> None:
    """Refuse (InputError) a budget larger than all of the device's memory: `--budget 1TiB` on a
    24 GiB machine ran without a word and admitted requests that could never fit."""
    total = device_total_bytes(device)
    if budget_bytes is None or total is None or budget_bytes <= total:
        return
    what = f"the GPU ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "this machine's RAM"
    # a fraction is read as a share of the card: on a CPU there is none, so it is not offered there
    fraction = " or a fraction such as 0.9" if device.type == "cuda" else ""
    raise InputError(f"memory budget {gib(budget_bytes)} is more than {what} holds ({gib(total)}); give at most "
                     f"{gib(total)} (e.g. --budget {int(total / 2**30 * 0.9)}GiB){fraction}")


def context_bytes(device: torch.device) -> int:
    """What the process holds on the device outside PyTorch's allocator (context, handles)."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def input_bytes(batch: int, length: int, shard_slots: int = 0) -> int:
    """Bytes of a step's per-token device tensors for `batch` sequences of `length` tokens, and
    under sequence parallelism the bookkeeping of its shard_slots masked slots."""
    return INPUT_BYTES_PER_TOKEN * batch * length + SHARD_BYTES_PER_SLOT * shard_slots


def arena_bytes(plan_bytes: int, granularity: int = ROUND_LARGE) -> int:
    """Pages the virtual-memory arena maps for a plan (its granularity: 2 MiB on the H200)."""
    return round_up(max(plan_bytes, 0), granularity)


def charged_fixed(weights: int, context: int, workspace: int = FIXED_BYTES, late: int = 0) -> int:
    """Bytes charged for every request whatever its size: weights + context + workspace (+ the
    late-load allowance on CUDA)."""
    return weights + context + workspace + late


def floor_bytes_per_token(cfg, itemsize: int = 2) -> int:
    """The x + K + V floor: the residual stream plus one layer's keys and values (bytes/token)."""
    return itemsize * (cfg.hidden + 2 * cfg.kv_dim)


@dataclass(frozen=True)
class Budget:
    """A device-memory budget and what is charged before any activation.

    budget_bytes None means no budget (nothing is refused); fixed_bytes = weights + context +
    workspace + late-load allowance (charged_fixed); rounding_bytes: the per-request allocator
    rounding (REQUEST_SLACK_BYTES + STEP_ROUNDING_BYTES on CUDA, 0 on a CPU)."""
    budget_bytes: int | None
    fixed_bytes: int
    weights_bytes: int
    context_bytes: int = 0
    workspace_bytes: int = FIXED_BYTES
    late_bytes: int = 0
    rounding_bytes: int = 0

    @classmethod
    def of(cls, budget, device: torch.device, weights: int, context: int | None = None,
           workspace: int | None = None) -> Budget:
        """budget: '40GiB', bytes, a fraction of the card, or None. context: measured bytes
        (default: measured on this device now); workspace: measured bytes (default FIXED_BYTES)."""
        ctx = context_bytes(device) if context is None else context
        budget_bytes = parse_bytes(budget, card_bytes(device))
        check_budget_total(budget_bytes, device)
        return cls.build(budget_bytes, weights, ctx,
                         FIXED_BYTES if workspace is None else workspace, cuda=device.type == "cuda")

    @classmethod
    def build(cls, budget_bytes: int | None, weights: int, context: int, workspace: int,
              cuda: bool = True) -> Budget:
        """The budget view of a process on a CUDA device (cuda=True: allocator rounding and the
        late-load allowance charged) or of a CPU run."""
        late = LATE_LOAD_BYTES if cuda else 0
        return cls(budget_bytes, charged_fixed(weights, context, workspace, late), weights, context,
                   workspace, late, REQUEST_SLACK_BYTES + STEP_ROUNDING_BYTES if cuda else 0)

    @classmethod
    def h200(cls, budget_bytes: int | None, weights: int, context: int | None = None,
             workspace: int | None = None) -> Budget:
        """What `mosaic plan` charges: the H200's measured context and workspace by default."""
        return cls.build(budget_bytes, weights, H200_CONTEXT_BYTES if context is None else context,
                         H200_WORKSPACE_BYTES if workspace is None else workspace, cuda=True)

    def with_workspace(self, workspace: int) -> Budget:
        """The same budget charging a measured workspace."""
        return dataclasses.replace(self, workspace_bytes=workspace, fixed_bytes=charged_fixed(
            self.weights_bytes, self.context_bytes, workspace, self.late_bytes))

    def activation_limit(self, batch: int, length: int, shard_slots: int = 0) -> int | None:
        """Bytes left for a step's plan + out-of-plan transients (None: unlimited)."""
        if self.budget_bytes is None:
            return None
        return self.budget_bytes - self.fixed_bytes - input_bytes(batch, length, shard_slots) - self.rounding_bytes

    def total(self, need_bytes: int, batch: int, length: int, shard_slots: int = 0) -> int:
        """What a step that needs `need_bytes` of activations holds on the device in all, at
        most (the driver's counter; the allocator's rounding charged at its worst)."""
        return need_bytes + self.fixed_bytes + input_bytes(batch, length, shard_slots) + self.rounding_bytes

    def breakdown(self, plan_bytes: int, external_bytes: int, batch: int, length: int) -> dict:
        """Every term of the prediction (bytes), for reports and the soak benchmark."""
        return {"weights_bytes": self.weights_bytes, "context_bytes": self.context_bytes,
                "workspace_bytes": self.workspace_bytes, "late_load_bytes": self.late_bytes,
                "input_bytes": input_bytes(batch, length), "rounding_bytes": self.rounding_bytes,
                "plan_bytes": plan_bytes, "external_bytes": external_bytes,
                "predicted_bytes": self.total(plan_bytes + external_bytes, batch, length)}


def kv_cache_bytes_per_token(cfg, batch: int = 1, itemsize: int = 2) -> int:
    """A block cache's persistent K/V per token of the sequence when every layer is on the
    device (bytes): num_layers x 2 x kv_dim x itemsize per sequence (memory/kv_store.py).
    LLaDA-8B: 32 x 2 x 4096 x 2 B = 512 KiB per token, 4 GiB at 8k tokens."""
    return batch * cfg.num_layers * 2 * cfg.kv_dim * itemsize


def refuse_below_fixed(budget: Budget, name: str, others_bytes: int, before_load: bool = False) -> None:
    """MemoryBudgetError when `budget` cannot hold what the model holds before any token: its
    weights, the context and workspace, and what other live engines of the process hold."""
    if budget.budget_bytes is None or budget.budget_bytes > budget.fixed_bytes:
        return
    held = f" (of which {gib(others_bytes)} held by other engines of this process)" if others_bytes > 2**20 else ""
    when = "; refused before loading them" if before_load else ""
    raise MemoryBudgetError(
        f"memory budget {gib(budget.budget_bytes)} is below what {name} holds before any token: "
        f"weights {gib(budget.weights_bytes)} + context and workspace "
        f"{gib(budget.fixed_bytes - budget.weights_bytes)}{held} = {gib(budget.fixed_bytes)}{when}",
        needed_bytes=budget.fixed_bytes, budget_bytes=budget.budget_bytes, max_tokens=0)
