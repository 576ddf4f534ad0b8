"""Sequence (context) parallelism over torch.distributed, execution side: which masked slots a
rank owns and how the per-slot results meet again. Each rank holds a contiguous slice of every
sequence's positions (Shard, chunk bounds and broadcast are graph primitives: graph/shard.py).

Per layer a rank builds K and V for its own rows only; every query chunk then attends to each
rank's K/V shard in turn — the owner broadcasts it, piece_rows rows at a time, into a small
receive buffer — merging the partial results in log-sum-exp form. A rank's floor is therefore
(x + K + V) / world plus the receive buffer,
so the longest context grows with the number of ranks (an all-gather of K/V would keep the whole
K + V on every rank: 16 KiB per token for LLaDA-8B, at most 1.5x more context however many
GPUs). At a million tokens attention is ~20 s of math per layer per rank against well under a
second of shard traffic over NVLink. FFN/MoE and the masked logits stay local; the Dream shift's
row j-1 crosses a shard boundary through a one-row halo; the sampler runs identically on every
rank (same canvas, same generator) after the per-slot results are exchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..graph.shard import Shard, broadcast, world
from ..graph.tensor import all_gather
from ..memory.accounting import context_bytes

# NCCL's own device memory, bounded (set where processes are launched; a value already in the
# environment wins). Per channel and peer NCCL keeps a buffer per protocol: Simple (NCCL_BUFFSIZE,
# 4 MiB by default), LL128 (~4.6 MiB) and LL (~0.5 MiB); the two-GPU runs measured ~0.8 GiB of context
# with NCCL's defaults against 0.7 GiB alone. 1 MiB x 8 channels keep the broadcast of a 16k-row
# piece (256 MiB) well above the ~100 GB/s the ring needs to hide behind attention (RING_CHUNKS),
# and whatever NCCL holds after its first collectives is measured and charged (startup_context).
NCCL_BOUNDS = {"NCCL_BUFFSIZE": str(1 << 20), "NCCL_MAX_NCHANNELS": "8",
               "TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}
# Generation.lossy under several processes in bf16/fp16 (docs/PARALLEL.md: measured difference)
LOSSY = "sequence parallelism: attention merged over K/V pieces rounds differently from one GPU's kernel"
# the same under tensor parallelism: the o and down projections' per-rank partials (each rounded
# to the model dtype by its product) are summed in float32 and rounded once more
TENSOR_LOSSY = ("tensor parallelism: the o and down projections sum per-rank partial products (float32, rank "
                "order), rounding differently from one GPU's product")
# message sizes of the warm-up broadcasts: NCCL picks its protocol by size (LL for small, LL128
# in between, Simple for large) and connects buffers for what it uses
WARM_BYTES = (8, 256 << 10, 32 << 20)


def localize(positions: torch.Tensor, L: int, B: int, shard: Shard, shift: bool):
    """Slots whose position this rank owns, and the local row each reads: its own position, or
    with the Dream shift position - 1 — the halo row (after the B*rows body) at a shard start."""
    j = positions % L
    b = positions // L
    mine = (j >= shard.lo) & (j < shard.hi)
    idx = mine.nonzero().squeeze(1)
    jj, bb = j[idx], b[idx]
    src = torch.where(jj > 0, jj - 1, jj) if shift else jj
    rows = torch.where(src >= shard.lo, bb * shard.rows + (src - shard.lo), B * shard.rows + bb)
    return idx, rows


def gather_outs(local: dict[str, torch.Tensor], idx: torch.Tensor, total: int,
                shard: Shard) -> dict[str, torch.Tensor]:
    """Every rank's per-slot results, assembled in slot order on every rank."""
    counts = torch.zeros(shard.world, dtype=torch.long, device=idx.device)
    counts[shard.rank] = idx.numel()
    for r in range(shard.world):
        broadcast(counts[r:r + 1], r, shard)
    full = {k: torch.empty(total, dtype=v.dtype, device=v.device) for k, v in local.items()}
    for r in range(shard.world):
        n = int(counts[r])
        if n == 0:
            continue
        ids = idx if r == shard.rank else torch.empty(n, dtype=torch.long, device=idx.device)
        broadcast(ids, r, shard)
        for k, v in local.items():
            part = v if r == shard.rank else torch.empty(n, dtype=v.dtype, device=v.device)
            broadcast(part, r, shard)
            full[k][ids] = part
    return full


def agree(values: list[int], device) -> list[int]:
    """The elementwise minimum of `values` (ints) over every rank, the same list on all ranks.
    By broadcasts, the only collective the engine issues (NCCL connects one algorithm's buffers)."""
    rank, size = world()
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    low, buf = mine.clone(), torch.empty_like(mine)
    for r in range(size):
        if r == rank:
            buf.copy_(mine)
        dist.broadcast(buf, src=r)
        torch.minimum(low, buf, out=low)
    return [int(v) for v in low.tolist()]


def warm_up(device, tensor: bool = False) -> None:
    """Every kind of transfer a step makes, once, so that the communicator and its buffers exist
    before the context is measured: broadcasts from every rank of small (per-slot results, halo
    rows), middle-sized and piece-sized messages, blocking and asynchronous; tensor: also the
    all-gathers of tensor parallelism's partial sums (the same sizes)."""
    rank, size = world()
    for nbytes in WARM_BYTES:
        t = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        for src in range(size):
            dist.broadcast(t, src=src)
            dist.broadcast(t, src=src, async_op=True).wait()
        if tensor:
            parts = torch.empty(size * nbytes, dtype=torch.uint8, device=device)
            all_gather(parts, t)
            del parts
        del t
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def startup_context(device, tensor: bool = False) -> int:
    """The device bytes this process holds outside PyTorch's allocator once NCCL is up (CUDA
    context + NCCL's communicator, buffers and kernels), the largest over all ranks: every rank
    charges the same, so budgets and chunk choices are the same on every rank. 0 on a CPU."""
    warm_up(device, tensor)
    return -agree([-context_bytes(torch.device(device))], device)[0]
