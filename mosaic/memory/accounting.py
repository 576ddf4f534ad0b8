"""Byte accounting: what the process holds on the device besides the plan, and the budget view.

Charged on top of a step's plan: the CUDA context (measured on the device; 0.60 GiB measured on
the H200 for planning on a CPU), the weights, a fixed workspace (cuBLAS, small tensors, allocator
rounding), the step's input index tensors, and whatever an op allocates outside the plan (the
template's external bytes). Policy (admission, capacity) sits above this and asks it for limits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import parse_bytes

H200_CONTEXT_BYTES = int(0.60 * 2**30)  # BENCHMARKS.md: CUDA context on this project's H200
FIXED_BYTES = 320 * 2**20               # cuBLAS workspaces, RNG state, small tensors, rounding
# the canvas and the sampler's per-token tensors on the device during a step: ids, positions,
# row list, full-length candidate ids and confidences, masks (int64 mostly)
INPUT_BYTES_PER_TOKEN = 64
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


def charged_fixed(weights: int, context: int) -> int:
    """Bytes charged for every request whatever its size: weights + context + fixed workspace."""
    return weights + context + FIXED_BYTES


def floor_bytes_per_token(cfg, itemsize: int = 2) -> int:
    """The x + K + V floor: the residual stream plus one layer's keys and values (bytes/token)."""
    return itemsize * (cfg.hidden + 2 * cfg.kv_dim)


@dataclass(frozen=True)
class Budget:
    """A device-memory budget and what is charged before any activation.

    budget_bytes None means no budget (nothing is refused); fixed_bytes = weights + context +
    fixed workspace (charged_fixed)."""
    budget_bytes: int | None
    fixed_bytes: int
    weights_bytes: int

    @classmethod
    def of(cls, budget, device: torch.device, weights: int, context: int | None = None) -> Budget:
        """budget: '40GiB', bytes, a fraction of the card, or None. context: measured bytes
        (default: measured on this device now)."""
        ctx = context_bytes(device) if context is None else context
        return cls(parse_bytes(budget, card_bytes(device)), charged_fixed(weights, ctx), weights)

    def activation_limit(self, batch: int, length: int, shard_slots: int = 0) -> int | None:
        """Bytes left for a step's plan + out-of-plan transients (None: unlimited)."""
        if self.budget_bytes is None:
            return None
        return self.budget_bytes - self.fixed_bytes - input_bytes(batch, length, shard_slots)

    def total(self, need_bytes: int, batch: int, length: int, shard_slots: int = 0) -> int:
        """What a step that needs `need_bytes` of activations holds on the device in all."""
        return need_bytes + self.fixed_bytes + input_bytes(batch, length, shard_slots)
