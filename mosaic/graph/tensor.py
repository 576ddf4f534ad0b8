"""Tensor parallelism's primitives: which heads and FFN columns a rank holds, and the one
reduction per attention and per FFN/MoE block (the row-parallel o and down projections).

Each rank holds a contiguous share of the K/V heads (the q heads that read them come with them:
grouped-query attention keeps its groups whole), of the FFN's hidden columns (a MoE: of its
routed experts, whole), and the full embedding, norms, router and LM head. A row-parallel
projection leaves each rank a partial sum [n, d] of the same rows; `reduce_partials` adds them.
The process-group glue (which rank loads which slice) sits above, in models/tensor_shard.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

F32 = torch.float32


@dataclass(frozen=True)
class TensorShard:
    """This rank's share of every layer's heads and FFN columns under tensor parallelism.
    rank, world: this process and the number of processes; group: the process group (None:
    the default group)."""
    rank: int
    world: int
    group: object = None

    def part(self, n: int) -> tuple[int, int]:
        """[lo, hi) of this rank's equal share of n items (heads, FFN columns); n must divide
        by world (models/tensor_shard.check_divides raises before anything is sliced)."""
        per = n // self.world
        return self.rank * per, (self.rank + 1) * per


def reduce_partials(y: torch.Tensor, parts: torch.Tensor, acc: torch.Tensor | None,
                    shard: TensorShard) -> None:
    """y [n, d] (this rank's partial sum of a row-parallel projection) becomes the sum of every
    rank's partial, the same bits on every rank.

    Algorithm: one all-gather of the partials into parts [world, n, d] (model dtype), then the sum
    in a fixed rank order, (p0 + p1) + p2 + ..., in float32: in acc [n, d] fp32 for a 16-bit model
    (rounded once to the model dtype at the end), in y itself for a float32 model (acc None). An
    all-reduce would sum in an order the library picks (NCCL's ring or tree, gloo's algorithm) and
    might round differently on different ranks; every rank must hold the same residual, because
    each runs the sampler on its own copy of the logits."""
    if y.numel() == 0:
        return
    all_gather(parts.view(-1), y.contiguous().view(-1), shard.group)
    out = y if acc is None else acc
    out.copy_(parts[0])
    for r in range(1, shard.world):
        out.add_(parts[r])
    if acc is not None:
        y.copy_(acc)


def all_gather(out: torch.Tensor, t: torch.Tensor, group=None) -> None:
    """Every rank's t (1-D, same size everywhere) into out [world * t.numel()], rank by rank (one
    collective: all_gather_single where torch has it, else all_gather_into_tensor)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, t, group=group)


def current(parallel: str) -> TensorShard | None:
    """This process's TensorShard when `parallel` is 'tensor' (EngineConfig.parallel) and
    torch.distributed runs with several ranks, else None (one process, or sequence parallelism)."""
    if parallel != "tensor" or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return TensorShard(dist.get_rank(), dist.get_world_size())
