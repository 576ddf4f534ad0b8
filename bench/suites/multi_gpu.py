"""Sequence parallelism on several GPUs: L_max per GPU, step latency, agreement (torchrun).

On two GPUs: L_max per GPU budget vs one GPU (NVML peaks per GPU), step latency vs one
GPU, and agreement with one GPU in bf16. One launch, ~6.5 minutes on 2 H200s, 7.7 at most (a
deadline skips what would not finish by --deadline-s; each case in try/except, the JSON rewritten
after each):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python -m torch.distributed.run --standalone --nproc_per_node 2 -m bench multi_gpu --out DIR

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
must stay within the budget by the driver's counter (bench.lib.measure.meter: this process's
bytes where NVML reports them, else the device's used bytes minus the baseline read before this
process touched the GPU) plus the weights a truncated model is charged but does not hold.
Writes multi_gpu.json (rank 0); a table last. --smoke runs the same flow on a CPU with gloo and
tiny-llada (no NVML), a check of the suite itself (~1 min on 2 cores):

    python -m torch.distributed.run --nproc_per_node 2 -m bench multi_gpu --smoke --out /tmp/mg"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback

import torch
import torch.distributed as dist

from bench.lib import engine as E
from bench.lib.measure import canvas, free, median, sync
from bench.lib.ranks import everyone, start_rank
from mosaic import GenerationConfig, MemoryBudgetError, MosaicEngine, load
from mosaic.graph.ctx import EagerCtx
from mosaic.graph.shard import current
from mosaic.launch import SAFE_ENV
from mosaic.memory.accounting import context_bytes
from mosaic.models.layers import step_program
from mosaic.models.step import make_step
from mosaic.policy.capacity import capacity_report
from mosaic.runtime import parallel

GiB = 2**30
# what is measured: the model of the L_max and latency runs, per-GPU budgets, step lengths, and
# the agreement models -> (prompts or a random prompt's length, generation options, logits length)
FULL = {"model": "llada-8b", "budgets": ("20GiB", "40GiB"), "lengths": (32768, 131072),
        "agree": {"tiny-llada": (["sort 31415926=", "12+30=", "sort 90817263=", "sort 4411="], {}, 256),
                  "tiny-dream": (["57+384=", "sort 4411=", "12+30=", "sort 321="], {}, 256),
                  "llada-8b": (4096, dict(max_new_tokens=4096, steps=4, block_length=4096), 8192)}}
SMOKE = {"model": "tiny-llada", "budgets": ("328MiB", "332MiB"), "lengths": (512, 1024),
         "agree": {"tiny-llada": (["sort 31415926=", "12+30="], {}, 64),
                   "tiny-dream": (["57+384=", "sort 4411="], {}, 64)}}
CFG = dict(FULL)


def add_arguments(ap):
    ap.add_argument("--layers", type=int, default=1, help="depth of the L_max probes (charged full weights)")
    ap.add_argument("--deadline-s", type=float, default=430.0)
    ap.add_argument("--smoke", action="store_true", help="the same flow on a CPU: gloo, tiny-llada")


# -- measurements
def lmax(budget: str, layers: int, world: int, dev: torch.device, m) -> dict:
    """The planner's L_max with the context this engine charges; admitted at L_max, refused at
    L_max + 1024; one step at L_max with the driver's counter (meter m) watching. layers 0: full
    depth."""
    model = load(CFG["model"], device=dev, num_layers=layers or None)
    engine = MosaicEngine(model, {"progress": False, "memory_budget": budget})
    b = E.budget(engine)
    # the engine's own context and workspace charges (fixed_bytes also holds the late-load
    # allowance, which the planner adds itself: passing fixed - weights as the context charged
    # it twice and made the planner's L_max ~1,000-3,000 tokens short of admission's)
    charged_ctx = b.context_bytes
    t = time.perf_counter()
    rep = capacity_report(load(CFG["model"], device="meta", dtype=model.dtype), budget, context_bytes=charged_ctx,
                          workspace_bytes=b.workspace_bytes, world=world, target=dev.type)
    n = rep["l_max"]
    if n < 1024:
        raise RuntimeError(f"the planner fits no 1024 tokens at {budget}: {rep}")
    rec = {"budget": budget, "world": world, "layers": layers or len(model.layers), "l_max": n,
           "plan_s": time.perf_counter() - t, "charged_context_bytes": charged_ctx, "budget_bytes": b.budget_bytes,
           "planned_chunks": rep["steps"][0]["chunks"] if rep["steps"] else None}
    adm = E.admit(engine, 1, n, GenerationConfig(max_new_tokens=n // 2))
    rec |= {"admitted": True, "predicted_bytes": adm.predicted_bytes, "chunks": list(adm.chunks)}
    try:
        E.admit(engine, 1, n + 1024, GenerationConfig(max_new_tokens=(n + 1024) // 2))
        rec["refused_next"] = False
    except MemoryBudgetError as e:
        rec |= {"refused_next": True, "longest_reported": e.max_tokens}
    x = canvas(model, n, n // 2)
    free(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    with (m if m is not None else contextlib.nullcontext()), \
            (m.window() if m is not None else contextlib.nullcontext()) as w:
        t = time.perf_counter()
        E.step(engine, x)
        sync(dev)
        rec["step_s"] = time.perf_counter() - t
    missing = E.missing_weight_bytes(model)
    rec["missing_weights_bytes"] = missing
    if w is not None:
        rec |= {"nvml_peak_bytes": w.peak_bytes, "nvml_mode": w.mode, "nvml_device_base_bytes": m.baseline_bytes}
    if dev.type == "cuda":
        rec |= {"counters_peak_bytes": context_bytes(dev) + torch.cuda.max_memory_reserved(dev)
                + E.arena_extra_bytes(engine), "context_after_bytes": context_bytes(dev),
                "charged_peak_bytes": w.peak_bytes + missing, "within_budget": w.peak_bytes + missing <= b.budget_bytes}
    del engine, model, x
    free(dev)
    return rec


def latency(engine, n: int, repeat: int, dev) -> dict:
    """ms of one step of n tokens (half masked) after admission planned it; repeat > 1: the
    first run is a warm-up, the median of the others is reported."""
    x = canvas(engine.model, n, n // 2)
    E.admit(engine, 1, n, GenerationConfig(max_new_tokens=n // 2))
    times = []
    for _ in range(repeat):
        sync(dev)
        t = time.perf_counter()
        E.step(engine, x)
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


# -- the flow
def run(args, rec) -> dict:
    CFG.clear()
    CFG.update(SMOKE if args.smoke else FULL)
    rank, world, dev, m = start_rank(args.smoke)
    rec.write, rec.hard_exit = rank == 0, True
    rec.update(model=CFG["model"], world=world, cases={})
    dl = args.deadline_s

    def dump(state: str) -> None:
        rec["state"], rec["seconds"] = state, rec.elapsed()
        rec.save()

    def case(name: str, fn, estimate_s: float, world: int):
        """fn() unless it would end past the deadline (all ranks agree), its result or error under name."""
        go = rec.elapsed() + estimate_s <= dl
        if world > 1:
            go = bool(parallel.agree([int(go)], dev)[0])
        if not go:
            rec["cases"][name] = {"skipped": f"estimated {estimate_s:.0f} s would pass the {dl:.0f} s deadline"}
            return None
        t = time.perf_counter()
        try:
            res = fn()
            res["seconds"] = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001  (recorded; the other cases still run)
            res = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            free(dev)
        rec["cases"][name] = res
        return res

    watchdog = threading.Timer(dl + 25, lambda: (dump("watchdog"), os._exit(3)))
    watchdog.daemon = True
    watchdog.start()
    b20, b40 = CFG["budgets"]
    short, long_ = CFG["lengths"]

    # -- phase A: one GPU per process, before the process group exists
    if rank == 0:
        case("lmax_1gpu_20GiB", lambda: lmax(b20, args.layers, 1, dev, m), 20, 1)
        model = load(CFG["model"], device=dev)
        engine = MosaicEngine(model, {"progress": False})
        case("latency_1gpu_short", lambda e=engine: latency(e, short, 3, dev), 10, 1)
        case("latency_1gpu_long", lambda e=engine: latency(e, long_, 1, dev), 35, 1)
        del engine, model
        free(dev)
        refs = {}
    else:
        case("lmax_1gpu_40GiB", lambda: lmax(b40, args.layers, 1, dev, m), 90, 1)
        refs = case("refs", lambda: {"tokens": one_gpu_tokens(dev)}, 40, 1) or {}
        refs = rec["cases"].pop("refs", {}) and refs.get("tokens", {})
    ctx0 = context_bytes(dev)
    mine = rec["cases"]
    rec["cases"] = {}

    # -- phase B: all ranks
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    t = time.perf_counter()
    parallel.warm_up(dev)
    ctx1 = context_bytes(dev)
    v = torch.cuda.nccl.version() if dev.type == "cuda" else ()
    rec["nccl"] = {"env": {k: os.environ.get(k) for k in list(parallel.NCCL_BOUNDS) + list(SAFE_ENV)},
                   "version": ".".join(map(str, v)) if isinstance(v, tuple) else str(v),
                   "context_before_bytes": ctx0, "context_after_bytes": ctx1,
                   "nccl_bytes_per_rank": [int(x[0]) for x in share([ctx1 - ctx0], dev)],
                   "warm_up_s": time.perf_counter() - t,
                   "broadcast_GBps": bandwidth(dev, (256 << 20) if dev.type == "cuda" else (4 << 20))}
    for r, cases in enumerate(everyone(mine, dev)):
        rec["cases"].update({f"{k}_rank{r}": v for k, v in cases.items()})
    refs = everyone(refs, dev)[1]
    dump("phase A")

    def two(fn):
        return lambda: {"ranks": everyone(fn(), dev)}
    case("lmax_2gpu_20GiB", two(lambda: lmax(b20, args.layers, world, dev, m)), 30, world)
    case("lmax_2gpu_40GiB", two(lambda: lmax(b40, args.layers, world, dev, m)), 150, world)
    dump("L_max")
    model = load(CFG["model"], device=dev)
    engine = MosaicEngine(model, {"progress": False})
    case("latency_2gpu_short", lambda e=engine: latency(e, short, 3, dev), 8, world)
    case("latency_2gpu_long", lambda e=engine: latency(e, long_, 1, dev), 25, world)
    del engine
    for name in CFG["agree"]:
        own = model if name == CFG["model"] else None
        case(f"agree_{name}", lambda name=name, o=own: agree_model(name, o, refs, dev), 15, world)
    engine = MosaicEngine(model, {"progress": False, "peer_overlap": False})
    case("latency_2gpu_short_no_overlap", lambda e=engine: latency(e, short, 3, dev), 8, world)
    del engine, model
    free(dev)
    dump("latency and agreement")
    one_layer = ((rec["cases"].get("lmax_2gpu_20GiB") or {}).get("ranks") or [{}])[0].get("step_s", 10.0)
    case("lmax_2gpu_20GiB_full_depth", two(lambda: lmax(b20, 0, world, dev, m)), 32 * one_layer * 1.1 + 20, world)
    dump("done")
    dist.destroy_process_group()
    return rec


def table(rec) -> str:
    if not rec.write:   # the other ranks print nothing
        return ""
    c = rec["cases"]
    nc = rec["nccl"]
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
    lines.append(f"total {rec['seconds_total']:.0f} s")
    return "\n".join(lines)
