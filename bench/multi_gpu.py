"""Issue 20 on two GPUs: L_max per GPU budget vs one GPU (NVML peaks per GPU), step latency vs one
GPU, and agreement with one GPU in bf16. One launch, ~6.5 minutes on 2 H200s, 7.7 at most (a deadline skips
what would not finish by --deadline-s; each case in try/except, the JSON rewritten after each):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python -m torch.distributed.run --standalone --nproc_per_node 2 bench/multi_gpu.py --out $OUT

Phase A, before the process group exists: each rank is a one-GPU process on its own GPU (the
one-GPU baselines, split over the two GPUs to halve the time). Rank 0: L_max at 20 GiB, step
latency at 32k and 128k tokens. Rank 1: L_max at 40 GiB, one-GPU tokens for the agreement runs
(SDPA, and cuDNN attention as a yardstick of what another correct kernel changes).
Phase B, two ranks (NCCL, NCCL_BOUNDS unless set): NCCL's bytes and broadcast bandwidth; L_max
at 20 and 40 GiB; latency at 32k and 128k (and 32k without overlap); agreement (logits relative
error and argmax agreement of every position, tokens of a greedy generation) on tiny-llada,
tiny-dream and llada-8b; last, llada-8b at full depth at the 20 GiB two-GPU L_max.

L_max probes run llada-8b cut to --layers layers and charged the full weights (a layer's plan
is the same at any depth); the planner's L_max (mosaic.policy.capacity, charged the context the
engine measured) must be admitted and L_max + 1024 refused by the engine, and the step at L_max
must stay within the budget by NVML: the process's peak device memory (sampled every 2 ms; the
device's total as a fallback) plus the weights a truncated model is charged but does not hold.
Writes multi_gpu.json (rank 0); a table last. --smoke runs the same flow on a CPU with gloo and
tiny-llada (no NVML): `python -m torch.distributed.run --nproc_per_node 2 bench/multi_gpu.py
--smoke --out /tmp/mg`, a check of the script itself (~1 min on 2 cores)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import multi_gpu_cases as C  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import record_header  # noqa: E402
from multi_gpu_cases import (  # noqa: E402
    NVML_BASE,
    Nvml,
    agree_model,
    free,
    latency,
    lmax,
    one_gpu_tokens,
    share,
    sync,
)

from mosaic import MosaicEngine, load  # noqa: E402
from mosaic.launch import SAFE_ENV  # noqa: E402
from mosaic.memory.accounting import context_bytes  # noqa: E402
from mosaic.runtime import parallel  # noqa: E402

GiB = 2**30
T0 = time.monotonic()
OUT: dict = {"cases": {}}


def elapsed() -> float:
    return time.monotonic() - T0



def case(name: str, fn, estimate_s: float, deadline: float, world: int, dev):
    """Run fn unless it would end past the deadline (all ranks agree), recording its result or
    its error under name."""
    go = elapsed() + estimate_s <= deadline
    if world > 1:
        go = bool(parallel.agree([int(go)], dev)[0])
    if not go:
        OUT["cases"][name] = {"skipped": f"estimated {estimate_s:.0f} s would pass the {deadline:.0f} s deadline"}
        return None
    t = time.perf_counter()
    try:
        res = fn()
        res["seconds"] = time.perf_counter() - t
    except Exception as e:  # noqa: BLE001  (recorded; the other cases still run)
        res = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        free(dev)
    OUT["cases"][name] = res
    return res


def everyone(obj, dev) -> list:
    """Every rank's picklable obj, in rank order, on every rank."""
    out = []
    for r in range(dist.get_world_size()):
        box = [obj if r == dist.get_rank() else None]
        dist.broadcast_object_list(box, src=r, device=dev if dev.type == "cuda" else None)
        out.append(box[0])
    return out


def bandwidth(dev, nbytes: int) -> float:
    """GB/s of broadcasts of nbytes from each rank in turn (the ring's piece transfers)."""
    t = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    for _ in range(2):   # the first round warms up
        sync(dev)
        s = time.perf_counter()
        for src in range(dist.get_world_size()):
            dist.broadcast(t, src=src)
        sync(dev)
    sec = time.perf_counter() - s
    del t
    free(dev)
    return dist.get_world_size() * nbytes / sec / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--layers", type=int, default=1, help="depth of the L_max probes (charged full weights)")
    ap.add_argument("--deadline-s", type=float, default=430.0)
    ap.add_argument("--smoke", action="store_true", help="the same flow on a CPU: gloo, tiny-llada")
    args = ap.parse_args()
    C.CFG.clear()
    C.CFG.update(C.SMOKE if args.smoke else C.FULL)
    os.environ.update(SAFE_ENV)
    for k, v in parallel.NCCL_BOUNDS.items():
        os.environ.setdefault(k, v)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    dev = torch.device("cpu") if args.smoke else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if dev.type == "cuda":
        meter = Nvml(dev)
        NVML_BASE[0] = meter.read()[1]
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    dl = args.deadline_s
    watchdog = threading.Timer(dl + 25, lambda: (dump(args.out, rank, "watchdog"), os._exit(3)))
    watchdog.daemon = True
    watchdog.start()
    b20, b40 = C.CFG["budgets"]
    short, long_ = C.CFG["lengths"]

    # -- phase A: one GPU per process, before the process group exists
    if rank == 0:
        case("lmax_1gpu_20GiB", lambda: lmax(b20, args.layers, 1, dev), 20, dl, 1, dev)
        model = load(C.CFG["model"], device=dev)
        engine = MosaicEngine(model, {"progress": False})
        case("latency_1gpu_short", lambda e=engine: latency(e, short, 3, dev), 10, dl, 1, dev)
        case("latency_1gpu_long", lambda e=engine: latency(e, long_, 1, dev), 35, dl, 1, dev)
        del engine, model
        free(dev)
        refs = {}
    else:
        case("lmax_1gpu_40GiB", lambda: lmax(b40, args.layers, 1, dev), 90, dl, 1, dev)
        refs = case("refs", lambda: {"tokens": one_gpu_tokens(dev)}, 40, dl, 1, dev) or {}
        refs = OUT["cases"].pop("refs", {}) and refs.get("tokens", {})
    ctx0 = context_bytes(dev)
    mine = OUT["cases"]
    OUT["cases"] = {}

    # -- phase B: two ranks
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    t = time.perf_counter()
    parallel.warm_up(dev)
    ctx1 = context_bytes(dev)
    v = torch.cuda.nccl.version() if dev.type == "cuda" else ()
    OUT["nccl"] = {"env": {k: os.environ.get(k) for k in list(parallel.NCCL_BOUNDS) + list(SAFE_ENV)},
                   "version": ".".join(map(str, v)) if isinstance(v, tuple) else str(v),
                   "context_before_bytes": ctx0, "context_after_bytes": ctx1,
                   "nccl_bytes_per_rank": [int(x[0]) for x in share([ctx1 - ctx0], dev)],
                   "warm_up_s": time.perf_counter() - t,
                   "broadcast_GBps": bandwidth(dev, (256 << 20) if dev.type == "cuda" else (4 << 20))}
    for r, cases in enumerate(everyone(mine, dev)):
        OUT["cases"].update({f"{k}_rank{r}": v for k, v in cases.items()})
    refs = everyone(refs, dev)[1]
    dump(args.out, rank, "phase A")

    def two(fn):
        return lambda: {"ranks": everyone(fn(), dev)}
    case("lmax_2gpu_20GiB", two(lambda: lmax(b20, args.layers, world, dev)), 30, dl, world, dev)
    case("lmax_2gpu_40GiB", two(lambda: lmax(b40, args.layers, world, dev)), 150, dl, world, dev)
    dump(args.out, rank, "L_max")
    model = load(C.CFG["model"], device=dev)
    engine = MosaicEngine(model, {"progress": False})
    case("latency_2gpu_short", lambda e=engine: latency(e, short, 3, dev), 8, dl, world, dev)
    case("latency_2gpu_long", lambda e=engine: latency(e, long_, 1, dev), 25, dl, world, dev)
    del engine
    for name in C.CFG["agree"]:
        mine = model if name == C.CFG["model"] else None
        case(f"agree_{name}", lambda name=name, m=mine: agree_model(name, m, refs, dev), 15, dl, world, dev)
    engine = MosaicEngine(model, {"progress": False, "peer_overlap": False})
    case("latency_2gpu_short_no_overlap", lambda e=engine: latency(e, short, 3, dev), 8, dl, world, dev)
    del engine, model
    free(dev)
    dump(args.out, rank, "latency and agreement")
    one_layer = ((OUT["cases"].get("lmax_2gpu_20GiB") or {}).get("ranks") or [{}])[0].get("step_s", 10.0)
    case("lmax_2gpu_20GiB_full_depth", two(lambda: lmax(b20, 0, world, dev)), 32 * one_layer * 1.1 + 20,
         dl, world, dev)
    dump(args.out, rank, "done")
    dist.destroy_process_group()
    if rank == 0:
        print(table())
    sys.stdout.flush()
    os._exit(0)


def dump(out: Path, rank: int, state: str) -> None:
    if rank:
        return
    OUT["state"], OUT["seconds"] = state, elapsed()
    OUT["header"] = record_header({"script": "bench/multi_gpu.py", "model": C.CFG["model"],
                                   "world": int(os.environ.get("WORLD_SIZE", "1"))})
    (out / "multi_gpu.json").write_text(json.dumps(OUT, indent=1, default=str) + "\n")


def table() -> str:
    c = OUT["cases"]
    nc = OUT["nccl"]
    lines = [f"NCCL {nc['version']}: {[round(b / 2**20) for b in nc['nccl_bytes_per_rank']]} MiB per rank "
             f"after warm-up, broadcast {nc['broadcast_GBps']:.0f} GB/s",
             f"{'budget':>7} {'L_max 1 GPU':>12} {'L_max 2 GPUs':>13} {'ratio':>6} {'peaks GiB 1 | 2 GPUs':>26} "
             f"{'within':>7} {'plan=admit':>10}"]
    for b, key in zip(C.CFG["budgets"], ("20GiB", "40GiB"), strict=True):
        one = c.get(f"lmax_1gpu_{key}_rank0") or c.get(f"lmax_1gpu_{key}_rank1") or {}
        twos = (c.get(f"lmax_2gpu_{key}") or {}).get("ranks") or []
        l1, l2 = one.get("l_max"), (twos[0].get("l_max") if twos else None)
        ratio = f"{l2 / l1:.3f}" if l1 and l2 else "-"
        peaks = [round(r.get("charged_peak_bytes", 0) / GiB, 2) for r in [one, *twos]]
        within = all(r.get("within_budget") for r in [one, *twos]) if twos else None
        agree = all(r.get("admitted") and r.get("refused_next") for r in [one, *twos]) if twos else None
        lines.append(f"{b:>7} {l1 or '-':>12} {l2 or '-':>13} {ratio:>6} {str(peaks):>26} {str(within):>7} "
                     f"{str(agree):>10}")
    for k in ("short", "long"):
        one = (c.get(f"latency_1gpu_{k}_rank0") or {}).get("ms")
        two = (c.get(f"latency_2gpu_{k}") or {}).get("ms")
        n = C.CFG["lengths"][k == "long"]
        sp = f"{one / two:.2f}x" if one and two else "-"
        lines.append(f"step at {n:>7,} tokens: 1 GPU {one or 0:8.0f} ms, 2 GPUs {two or 0:8.0f} ms ({sp})")
    no = (c.get("latency_2gpu_short_no_overlap") or {}).get("ms")
    lines.append(f"  2 GPUs without overlap at {C.CFG['lengths'][0]:,}: {no or 0:.0f} ms")
    nan = float("nan")
    for name in C.CFG["agree"]:
        r = c.get(f"agree_{name}") or {}
        lines.append(f"agreement {name:>10}: logits rel err {r.get('logits_rel_err', nan):.2e} (one GPU cuDNN "
                     f"vs SDPA {r.get('cudnn_vs_sdpa_rel_err', nan):.2e}), argmax {r.get('argmax_agree', nan):.4f}, "
                     f"tokens {r.get('tokens_agree')} (cuDNN {r.get('cudnn_one_gpu_tokens_agree')})")
    fd = (c.get("lmax_2gpu_20GiB_full_depth") or {}).get("ranks") or [{}]
    lines.append(f"full depth at the {C.CFG['budgets'][0]} 2-GPU L_max: peaks "
                 f"{[round(r.get('charged_peak_bytes', 0) / GiB, 2) for r in fd]} GiB, {fd[0].get('step_s', 0):.0f} s"
                 f" (skipped: {c.get('lmax_2gpu_20GiB_full_depth', {}).get('skipped')})")
    lines.append(f"total {elapsed():.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
