"""Issue 8 on a multi-GPU machine: L_max of LLaDA-8B at 40 GiB per GPU on K GPUs vs 1, verified,
and the step latency at a length every K fits. Launch (NVLink multicast stays off):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python -m torch.distributed.run --standalone --nproc_per_node K bench/multi_gpu.py --out $OUT

Each rank runs the capacity probe (mask ratio 1) at the planner's L_max for K ranks on a
depth-truncated model charged the full weights, and reports its device counters; rank 0 writes
multi_gpu_K.json."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_memory import peak_counters
from common import canvas, median, record_header, reset_peaks, step_fns, timed

from mosaic import GenerationConfig, MosaicEngine, load
from mosaic.cli import SAFE_ENV
from mosaic.memory.accounting import FIXED_BYTES
from mosaic.policy.capacity import capacity_report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llada-8b")
    ap.add_argument("--budget", default="40GiB")
    ap.add_argument("--latency-tokens", type=int, default=32768)
    ap.add_argument("--no-capacity", action="store_true", help="latency only (e.g. the 1-GPU baseline)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    os.environ.update(SAFE_ENV)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    rec = {"world": world}
    # latency at a length all world sizes fit (full depth)
    engine = MosaicEngine(load(args.model, device="cuda"), {"progress": False})
    x = canvas(engine.model, args.latency_tokens, args.latency_tokens // 2)
    rec["step_ms"] = median(timed(step_fns(engine, x, native=False), repeat=3))
    del engine, x
    torch.cuda.empty_cache()
    if not args.no_capacity:
        rec |= capacity(args, world)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        out = {**record_header({"model": args.model, "budget": args.budget, "world": world}), **rec}
        (args.out / f"multi_gpu_{world}.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"world {world}: step at {args.latency_tokens:,} tokens {rec['step_ms']:.0f} ms; L_max "
              f"{rec.get('l_max', 0):,} tokens, per-rank peaks "
              f"{[round(b / 2**30, 2) for b in rec.get('measured_bytes_per_rank', [])]} GiB")
    dist.destroy_process_group()


def capacity(args, world) -> dict:
    """The capacity probe at the planner's L_max for this many GPUs, every rank's device peak."""
    model = load(args.model, device="cuda", num_layers=1)
    engine = MosaicEngine(model, {"progress": False, "memory_budget": args.budget})
    ctx = engine.fixed_bytes - model.weight_bytes() - FIXED_BYTES
    rep = capacity_report(load(args.model, device="meta"), args.budget, context_bytes=ctx, world=world)
    n = rep["l_max"]
    m = n // 2
    engine.admit((1, n), GenerationConfig(max_new_tokens=m))
    x = canvas(model, n, m)
    reset_peaks()
    t0 = time.perf_counter()
    step_fns(engine, x, native=False)()
    torch.cuda.synchronize()
    mine = torch.tensor([peak_counters(engine), time.perf_counter() - t0], dtype=torch.float64, device="cuda")
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return {"l_max": n, "report": rep, "measured_bytes_per_rank": [int(e[0]) for e in every],
            "seconds": float(every[0][1]), "budget_bytes": rep["budget_bytes"],
            "within_budget": all(int(e[0]) <= rep["budget_bytes"] for e in every)}


if __name__ == "__main__":
    main()
