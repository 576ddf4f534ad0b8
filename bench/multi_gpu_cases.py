"""The measurements of bench/multi_gpu.py (issue 20): L_max with NVML peaks, step latency,
agreement with one GPU. CFG says what is measured (FULL on two GPUs, SMOKE on a CPU)."""

from __future__ import annotations

import gc
import os
import threading
import time

import torch
import torch.distributed as dist
from common import canvas, median

from mosaic import GenerationConfig, MemoryBudgetError, MosaicEngine, load
from mosaic.graph.ctx import EagerCtx
from mosaic.graph.shard import current
from mosaic.memory.accounting import context_bytes
from mosaic.models.layers import step_program
from mosaic.models.step import make_step
from mosaic.policy.capacity import capacity_report

GiB = 2**30
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
CFG = dict(FULL)


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
