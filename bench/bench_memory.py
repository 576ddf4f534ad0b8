"""Issue 5: the virtual-memory arena and the budget on the GPU.

  vmm_cycles    100 map/unmap cycles: the device's free memory returns to its start (<= 2 MiB)
  budget_steps  random (N, M) steps under a budget: device counters never above it; an
                over-budget request is refused before any allocation, and the next one runs
  inflation     16-step decode with falling M: reserved (or mapped) peak / LOAD - 1 for PyTorch's
                caching allocator, expandable_segments (a child process) and the arena

    python bench/bench_memory.py --inflation-child N   (what the child process runs)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
from common import canvas, device_used, expandable_env, free, step_fns

from mosaic import MemoryBudgetError, MosaicEngine, load
from mosaic.graph.ctx import EagerCtx
from mosaic.models.layers import step_program
from mosaic.models.step import make_step
from mosaic.runtime.reducers import LLaDAReducer

GiB = 2**30


def vmm_cycles(cycles=100) -> dict:
    from mosaic.memory.vmm import VmmArena
    warm = VmmArena(torch.device("cuda"))   # load the kernels and handles this test uses first:
    warm.ensure(2**20)                      # lazily loaded CUDA modules take device memory
    warm.tensor().fill_(1)
    warm.close()
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    a = VmmArena(torch.device("cuda"), hysteresis=0.5)
    g = torch.Generator().manual_seed(0)
    t_map = t_unmap = 0.0
    for _ in range(cycles):
        big = int(torch.randint(64, 8192, (1,), generator=g)) * 2**20
        t0 = time.perf_counter()
        a.ensure(big)
        t_map += time.perf_counter() - t0
        a.tensor()[: big].fill_(1)             # touch the pages
        t0 = time.perf_counter()
        a.ensure(2**20)                        # shrink: unmapped once the event completes
        torch.cuda.synchronize()
        a._reap()
        t_unmap += time.perf_counter() - t0
    mid_free = torch.cuda.mem_get_info()[0]
    maps, unmaps = a.map_calls, a.unmap_calls
    a.close()
    torch.cuda.synchronize()
    free1 = torch.cuda.mem_get_info()[0]
    return {"cycles": cycles, "free_start": free0, "free_end": free1, "free_delta_bytes": free0 - free1,
            "free_delta_while_open_bytes": free0 - mid_free, "map_calls": maps, "unmap_calls": unmaps,
            "map_us_per_handle": t_map / max(maps, 1) * 1e6,
            "unmap_us_per_handle": t_unmap / max(unmaps, 1) * 1e6,
            "within_2MiB": abs(free0 - free1) <= 2 * 2**20}


def budget_steps(steps=200, budget="40GiB", max_tokens=49152, layers=2) -> dict:
    model = load("llada-8b", device="cuda", num_layers=layers)
    engine = MosaicEngine(model, {"progress": False, "memory_budget": budget})
    limit = engine.memory_report()["budget_bytes"]
    torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(1)
    worst = 0
    gen = engine.generation_config(None, max_new_tokens=1)
    refused_steps = 0
    for _ in range(steps):
        n = int(torch.randint(1024, max_tokens, (1,), generator=g))
        m = int(torch.randint(1, n // 2, (1,), generator=g))
        try:
            engine.admit((1, n), gen.__class__(max_new_tokens=m))
        except MemoryBudgetError:
            refused_steps += 1
            continue
        step_fns(engine, canvas(model, n, m), native=False)()
        torch.cuda.synchronize()
        used = device_used() - charge_offset(engine)
        peak = peak_counters(engine)
        worst = max(worst, used, peak)
    rep = engine.memory_report()
    # an over-budget request: refused before anything is allocated, then the next one runs
    before = device_used()
    try:
        engine.generate(list(range(100)) * 40000, max_new_tokens=64, steps=1)
        refused = None
    except MemoryBudgetError as e:
        refused = str(e)
    after = device_used()
    nxt = engine.generate(list(range(100)), max_new_tokens=16, steps=4)
    res = {"steps": steps, "budget_bytes": limit, "max_tokens": max_tokens, "layers": layers,
           "charged_weights_bytes": model.weight_bytes(), "worst_device_bytes": worst,
           "within_budget": worst <= limit, "refused_steps": refused_steps, "refusal": refused,
           "refusal_allocated_bytes": after - before, "next_request_tokens": int(nxt.tokens.numel()),
           "report": rep}
    del engine, model
    free()
    return res


def charge_offset(engine) -> int:
    """A truncated model holds fewer weights than it is charged: count the missing ones as used."""
    return -(engine.model.weight_bytes() - sum(
        t.numel() * t.element_size() for t in [engine.model.embed, engine.model.lm_head, engine.model.final_norm]
        + [w for lw in engine.model.layers for w in lw.values()]))


OTHER_BYTES = int(os.environ.get("MOSAIC_BENCH_OTHER_BYTES", "0"))  # a parent process's usage


def peak_counters(engine) -> int:
    from mosaic.memory.accounting import context_bytes
    ctx = context_bytes(engine.model.device) - engine.arena_extra_bytes(now=True) - OTHER_BYTES
    return ctx + torch.cuda.max_memory_reserved() + engine.arena.peak_bytes * (engine.arena.kind == "vmm") \
        - charge_offset(engine)


def decode_eager(n: int, layers: int = 2, steps: int = 16) -> dict:
    """The Mosaic program (mask-only logits) with PyTorch's allocator for every buffer."""
    model = load("llada-8b", device="cuda", num_layers=layers)
    from mosaic import GenerationConfig
    gen = GenerationConfig(max_new_tokens=1)
    from mosaic.runtime.templates import TemplateCache
    runner = TemplateCache(model)
    loads = []
    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    for i in range(steps):
        m = max(1, (n // 2) * (steps - i) // steps)
        x = canvas(model, n, m, seed=i)
        rows = (x == model.cfg.mask_id).reshape(-1).nonzero().squeeze(1)
        step = make_step(model.cfg, x, None, rows=rows,
                         reducer=LLaDAReducer(model.cfg, gen, rows.tolist(), n, None, x.device))
        tpl, _, _ = runner.template(step, step.chunks)
        loads.append(max(a + b for a, b in zip(tpl.live_bytes(), tpl.external)))
        step_program(EagerCtx(model.device, model.dtype), model, step)
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved() - base
    return {"tokens": n, "peak_reserved_bytes": peak, "load_bytes": max(loads),
            "inflation": peak / max(loads) - 1,
            "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", "default")}


def decode_arena(n: int, layers: int = 2, steps: int = 16) -> dict:
    model = load("llada-8b", device="cuda", num_layers=layers)
    engine = MosaicEngine(model, {"progress": False})
    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    for i in range(steps):
        m = max(1, (n // 2) * (steps - i) // steps)
        step_fns(engine, canvas(model, n, m, seed=i), native=False)()
    torch.cuda.synchronize()
    hist = engine.history
    tpls = [engine.templates.get(h.key) for h in hist]
    load_ = max(max(a + b for a, b in zip(t.live_bytes(), t.external)) for t in tpls if t is not None)
    mapped = engine.arena.peak_bytes if engine.arena.kind == "vmm" else 0
    torch_peak = torch.cuda.max_memory_reserved() - base
    total = mapped + torch_peak
    res = {"tokens": n, "arena": engine.arena.kind, "arena_peak_bytes": engine.arena.peak_bytes,
           "plan_load_bytes": max(h.load_bytes for h in hist),
           "torch_peak_reserved_bytes": torch_peak, "load_bytes": load_,
           "inflation": total / load_ - 1,
           "arena_inflation": engine.arena.peak_bytes / max(h.load_bytes for h in hist) - 1}
    del engine, model
    free()
    return res


def inflation(lengths=(32768, 131072)) -> list[dict]:
    out = []
    for n in lengths:
        rec = {"tokens": n, "arena": decode_arena(n), "caching": decode_eager(n)}
        free()
        child = subprocess.run([sys.executable, __file__, "--inflation-child", str(n)], env=expandable_env(),
                               capture_output=True, text=True, cwd=os.path.dirname(__file__))
        rec["expandable"] = json.loads(child.stdout.strip().splitlines()[-1]) if child.returncode == 0 \
            else {"error": child.stderr[-2000:]}
        out.append(rec)
        print(f"  inflation N={n}: arena {rec['arena']['inflation']:.4f}, caching "
              f"{rec['caching']['inflation']:.4f}, expandable {rec['expandable'].get('inflation')}", flush=True)
    return out


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--inflation-child":
    print(json.dumps(decode_eager(int(sys.argv[2]))))
