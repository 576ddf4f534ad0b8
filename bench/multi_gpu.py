"""Issue 20 on two GPUs: L_max per GPU budget vs one GPU (NVML peaks per GPU), step latency vs one
GPU, and agreement with one GPU in bf16. One launch, ~6-7 minutes on 2 H200s (a deadline skips
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
--smoke --out /tmp/mg`, a check of the script itself (~3 min on 2 cores)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import canvas, median, record_header  # noqa: E402

from mosaic import GenerationConfig, MemoryBudgetError, MosaicEngine, load  # noqa: E402
from mosaic.graph.ctx import EagerCtx  # noqa: E402
from mosaic.graph.shard import current  # noqa: E402
from mosaic.launch import SAFE_ENV  # noqa: E402
from mosaic.memory.accounting import FIXED_BYTES, context_bytes  # noqa: E402
from mosaic.models.layers import step_program  # noqa: E402
from mosaic.models.step import make_step  # noqa: E402
from mosaic.policy.capacity import capacity_report  # noqa: E402
from mosaic.runtime import parallel  # noqa: E402

GiB = 2**30
T0 = time.monotonic()
OUT: dict = {"cases": {}}
# what is measured: the model of the L_max and latency runs, per-GPU budgets, step lengths, and
# the agreement models -> (prompts or a random prompt's length, generation options, logits length)
FULL = {"model": "llada-8b", "budgets": ("20GiB", "40GiB"), "lengths": (32768, 131072),
        "agree": {"tiny-llada": (["sort 31415926=", "12+30=", "sort 90817263=", "sort 4411="], {}, 256),
                  "tiny-dream": (["57+384=", "sort 4411=", "12+30=", "sort 321="], {}, 256),
                  "llada-8b": (4096, dict(max_new_tokens=4096, steps=4, block_length=4096), 8192)}}
SMOKE = {"model": "tiny-llada", "budgets": ("328MiB", "332MiB"),
         "lengths": (512, 1024),
         "agree": {"tiny-llada": (["sort 31415926=", "12+30="], {}, 64),
                   "tiny-dream": (["57+384=", "sort 4411="], {}, 64)}}
CFG = FULL


def elapsed() -> float:
    return time.monotonic() - T0


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()


class Nvml:
    """Peak device memory of this process (and of the whole device) on its GPU, sampled in a
    thread every 2 ms through NVML (pynvml, nvidia-ml-py). Off a GPU: no readings."""

    def __init__(self, dev: torch.device):
        self.N, self.h, self.pid = None, None, os.getpid()
        if dev.type != "cuda":
            return
        import pynvml as N
        N.nvmlInit()
        self.N = N
        try:
            self.h = N.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(dev).uuid}")
        except Exception:  # noqa: BLE001  (older torch or driver: the CUDA index)
            self.h = N.nvmlDeviceGetHandleByIndex(dev.index or 0)

    def read(self) -> tuple[int | None, int | None]:
        if self.N is None:
            return None, None
        mine = None
        try:
            for p in self.N.nvmlDeviceGetComputeRunningProcesses(self.h):
                if p.pid == self.pid and p.usedGpuMemory is not None:
                    mine = int(p.usedGpuMemory)
        except self.N.NVMLError:
            pass
        return mine, int(self.N.nvmlDeviceGetMemoryInfo(self.h).used)

    def __enter__(self):
        self.peak, self.dev_peak = None, None
        self.stop = threading.Event()

        def loop():
            while not self.stop.is_set():
                mine, dev = self.read()
                if mine is not None:
                    self.peak = max(self.peak or 0, mine)
                if dev is not None:
                    self.dev_peak = max(self.dev_peak or 0, dev)
                time.sleep(0.002)
        self.t = threading.Thread(target=loop, daemon=True)
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join()


NVML_BASE: list = [None]   # the device's NVML "used" before this process touched it


def resident_weights(model) -> int:
    seen, total = set(), 0
    for t in [model.embed, model.final_norm, model.lm_head, model.inv_freq] + \
            [w for lw in model.layers for w in lw.values()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def lmax(budget: str, layers: int, world: int, dev: torch.device) -> dict:
    """The planner's L_max with the context this engine charges; admitted at L_max, refused at
    L_max + 1024; one step at L_max with NVML watching. layers 0: full depth."""
    model = load(CFG["model"], device=dev, num_layers=layers or None)
    engine = MosaicEngine(model, {"progress": False, "memory_budget": budget})
    b = engine.budget
    charged_ctx = b.fixed_bytes - b.weights_bytes - FIXED_BYTES
    t = time.perf_counter()
    rep = capacity_report(load(CFG["model"], device="meta", dtype=model.dtype), budget, context_bytes=charged_ctx,
                          world=world, target=dev.type)
    n = rep["l_max"]
    if n < 1024:
        raise RuntimeError(f"the planner fits no 1024 tokens at {budget}: {rep}")
    rec = {"budget": budget, "world": world, "layers": layers or len(model.layers), "l_max": n,
           "plan_s": time.perf_counter() - t, "charged_context_bytes": charged_ctx, "budget_bytes": b.budget_bytes,
           "planned_chunks": rep["steps"][0]["chunks"] if rep["steps"] else None}
    adm = engine.admit(1, n, GenerationConfig(max_new_tokens=n // 2))
    rec |= {"admitted": True, "predicted_bytes": adm.predicted_bytes, "chunks": list(adm.chunks)}
    try:
        engine.admit(1, n + 1024, GenerationConfig(max_new_tokens=(n + 1024) // 2))
        rec["refused_next"] = False
    except MemoryBudgetError as e:
        rec |= {"refused_next": True, "longest_reported": e.max_tokens}
    x = canvas(model, n, n // 2)
    free(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    with Nvml(dev) as meter:
        t = time.perf_counter()
        engine.step(x)
        sync(dev)
        rec["step_s"] = time.perf_counter() - t
    missing = model.weight_bytes() - resident_weights(model)
    rec |= {"nvml_process_peak_bytes": meter.peak, "nvml_device_peak_bytes": meter.dev_peak,
            "nvml_device_base_bytes": NVML_BASE[0], "missing_weights_bytes": missing}
    if dev.type == "cuda":
        peak = meter.peak if meter.peak is not None else meter.dev_peak - (NVML_BASE[0] or 0)
        rec |= {"counters_peak_bytes": context_bytes(dev) + torch.cuda.max_memory_reserved(dev)
                + engine.arena_extra_bytes(), "context_after_bytes": context_bytes(dev),
                "charged_peak_bytes": peak + missing, "within_budget": peak + missing <= b.budget_bytes}
    del engine, model, x
    free(dev)
    return rec


def latency(engine, n: int, repeat: int, dev) -> dict:
    """ms of one step of n tokens (half masked) after admission planned it; repeat > 1: the
    first run is a warm-up, the median of the others is reported."""
    x = canvas(engine.model, n, n // 2)
    engine.admit(1, n, GenerationConfig(max_new_tokens=n // 2))
    times = []
    for _ in range(repeat):
        sync(dev)
        t = time.perf_counter()
        engine.step(x)
        sync(dev)
        times.append((time.perf_counter() - t) * 1e3)
    del x
    return {"tokens": n, "ms": median(times[1:] if repeat > 1 else times), "runs_ms": times}


def logits(model, x: torch.Tensor, shard, attention: str = "sdpa") -> torch.Tensor:
    """Logits [rows, V] of this rank's rows (shard) or of every row (None): one eager forward."""
    ctx = EagerCtx(model.device, model.dtype, attention_kernel=attention)
    with torch.no_grad():
        out = step_program(ctx, model, make_step(model.cfg, x, None, shard=shard))
    return out[: (shard.rows if shard else x.shape[1])]


def share(values: list[float], dev) -> list[list[float]]:
    """Every rank's values (floats) on every rank, by broadcasts."""
    out = []
    for r in range(dist.get_world_size()):
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        dist.broadcast(t, src=r)
        out.append(t.tolist())
    return out


def agreement_logits(model, n: int, dev) -> dict:
    """Relative error (Frobenius) and argmax agreement of the sharded logits vs one GPU's over
    every position; the same for one GPU with cuDNN attention vs SDPA, as a yardstick."""
    x = canvas(model, n, n // 2, seed=3)
    sh = current(n)
    one = logits(model, x, None)[sh.lo:sh.hi].float()
    two = logits(model, x, sh).float()
    cud = logits(model, x, None, "cudnn")[sh.lo:sh.hi].float()
    sums = [float(((two - one) ** 2).sum()), float((one ** 2).sum()),
            float((two.argmax(-1) == one.argmax(-1)).sum()), float(((cud - one) ** 2).sum()),
            float((cud.argmax(-1) == one.argmax(-1)).sum()), float(one.shape[0])]
    tot = [sum(c) for c in zip(*share(sums, dev), strict=True)]
    return {"tokens": n, "logits_rel_err": (tot[0] / tot[1]) ** 0.5, "argmax_agree": tot[2] / tot[5],
            "cudnn_vs_sdpa_rel_err": (tot[3] / tot[1]) ** 0.5, "cudnn_vs_sdpa_argmax_agree": tot[4] / tot[5]}


def prompts_for(name, model):
    p = CFG["agree"][name][0]
    if isinstance(p, int):
        g = torch.Generator().manual_seed(7)
        return torch.randint(0, model.cfg.mask_id - 1, (p,), generator=g).tolist()
    return p


def gen_tokens(model, name, attention="sdpa") -> torch.Tensor:
    engine = MosaicEngine(model, {"progress": False, "attention": attention})
    out = engine.generate(prompts_for(name, model), progress=False, **CFG["agree"][name][1]).tokens.cpu()
    del engine
    return out


def one_gpu_tokens(dev) -> dict:
    """Phase A: the one-GPU tokens of every agreement model (SDPA, and cuDNN attention)."""
    refs = {}
    for name in CFG["agree"]:
        model = load(name, device=dev)
        for attn in ("sdpa", "cudnn"):
            refs[f"{name}/{attn}"] = gen_tokens(model, name, attn)
        del model
        free(dev)
    return refs


def agree_model(name: str, model, refs: dict, dev) -> dict:
    own = model is None
    model = model or load(name, device=dev)
    rec = agreement_logits(model, CFG["agree"][name][2], dev)
    two = gen_tokens(model, name)
    sdpa, cudnn = refs.get(f"{name}/sdpa"), refs.get(f"{name}/cudnn")
    rec["generated_tokens"] = int(two.numel())
    rec["tokens_agree"] = float((two == sdpa).float().mean()) if sdpa is not None else None
    rec["cudnn_one_gpu_tokens_agree"] = float((cudnn == sdpa).float().mean()) if sdpa is not None else None
    if own:
        del model
    free(dev)
    return rec


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
    global CFG
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--layers", type=int, default=1, help="depth of the L_max probes (charged full weights)")
    ap.add_argument("--deadline-s", type=float, default=450.0)
    ap.add_argument("--smoke", action="store_true", help="the same flow on a CPU: gloo, tiny-llada")
    args = ap.parse_args()
    CFG = SMOKE if args.smoke else FULL
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
    b20, b40 = CFG["budgets"]
    short, long_ = CFG["lengths"]

    # -- phase A: one GPU per process, before the process group exists
    if rank == 0:
        case("lmax_1gpu_20GiB", lambda: lmax(b20, args.layers, 1, dev), 20, dl, 1, dev)
        model = load(CFG["model"], device=dev)
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
    model = load(CFG["model"], device=dev)
    engine = MosaicEngine(model, {"progress": False})
    case("latency_2gpu_short", lambda e=engine: latency(e, short, 3, dev), 8, dl, world, dev)
    case("latency_2gpu_long", lambda e=engine: latency(e, long_, 1, dev), 25, dl, world, dev)
    del engine
    for name in CFG["agree"]:
        mine = model if name == CFG["model"] else None
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
    OUT["header"] = record_header({"script": "bench/multi_gpu.py", "model": CFG["model"],
                                   "world": int(os.environ.get("WORLD_SIZE", "1"))})
    (out / "multi_gpu.json").write_text(json.dumps(OUT, indent=1, default=str) + "\n")


def table() -> str:
    c = OUT["cases"]
    nc = OUT["nccl"]
    lines = [f"NCCL {nc['version']}: {[round(b / 2**20) for b in nc['nccl_bytes_per_rank']]} MiB per rank "
             f"after warm-up, broadcast {nc['broadcast_GBps']:.0f} GB/s",
             f"{'budget':>7} {'L_max 1 GPU':>12} {'L_max 2 GPUs':>13} {'ratio':>6} {'peaks GiB 1 | 2 GPUs':>26} "
             f"{'within':>7} {'plan=admit':>10}"]
    for b, key in zip(CFG["budgets"], ("20GiB", "40GiB"), strict=True):
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
        n = CFG["lengths"][k == "long"]
        sp = f"{one / two:.2f}x" if one and two else "-"
        lines.append(f"step at {n:>7,} tokens: 1 GPU {one or 0:8.0f} ms, 2 GPUs {two or 0:8.0f} ms ({sp})")
    no = (c.get("latency_2gpu_short_no_overlap") or {}).get("ms")
    lines.append(f"  2 GPUs without overlap at {CFG['lengths'][0]:,}: {no or 0:.0f} ms")
    nan = float("nan")
    for name in CFG["agree"]:
        r = c.get(f"agree_{name}") or {}
        lines.append(f"agreement {name:>10}: logits rel err {r.get('logits_rel_err', nan):.2e} (one GPU cuDNN "
                     f"vs SDPA {r.get('cudnn_vs_sdpa_rel_err', nan):.2e}), argmax {r.get('argmax_agree', nan):.4f}, "
                     f"tokens {r.get('tokens_agree')} (cuDNN {r.get('cudnn_one_gpu_tokens_agree')})")
    fd = (c.get("lmax_2gpu_20GiB_full_depth") or {}).get("ranks") or [{}]
    lines.append(f"full depth at the {CFG['budgets'][0]} 2-GPU L_max: peaks "
                 f"{[round(r.get('charged_peak_bytes', 0) / GiB, 2) for r in fd]} GiB, {fd[0].get('step_s', 0):.0f} s"
                 f" (skipped: {c.get('lmax_2gpu_20GiB_full_depth', {}).get('skipped')})")
    lines.append(f"total {elapsed():.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
