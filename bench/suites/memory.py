"""The virtual-memory arena and the budget on the GPU: map cycles, random steps, inflation.

    python -m bench memory --out DIR [--quick] [--only vmm_cycles budget_steps ...]

Sections:
  vmm_cycles    100 map/unmap cycles: the device's free memory returns to its start (<= 2 MiB)
  budget_steps  200 random (N, M) steps at 40 GiB: device counters never above the budget; an
                over-budget request is refused before any allocation, and the next one runs
  budget_tight  the same, 40 steps at 17 GiB
  inflation     16-step decode with falling M: reserved (or mapped) peak / LOAD - 1 for PyTorch's
                caching allocator, the arena, and expandable_segments (a child process running
                `python -m bench memory --only decode_eager --tokens N`)
  decode_eager  that child's measurement alone (not run by default)"""

from __future__ import annotations

import os
import tempfile
import time

import torch

from bench.lib import engine as E
from bench.lib.measure import canvas, device_used, expandable_env, free
from bench.lib.record import child_record
from mosaic import GenerationConfig, MemoryBudgetError, MosaicEngine, load
from mosaic.graph.ctx import EagerCtx
from mosaic.models.layers import step_program
from mosaic.models.step import make_step
from mosaic.runtime.reducers import LLaDAReducer

GiB = 2**30
DEFAULT = ("vmm_cycles", "budget_steps", "budget_tight", "inflation")


def add_arguments(ap):
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--only", nargs="*", choices=DEFAULT + ("decode_eager",))
    ap.add_argument("--tokens", type=int, nargs="*", default=None,
                    help="inflation / decode_eager lengths (default 32k 128k; --quick 8k)")


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
    refused_steps = 0
    for _ in range(steps):
        n = int(torch.randint(1024, max_tokens, (1,), generator=g))
        m = int(torch.randint(1, n // 2, (1,), generator=g))
        try:
            E.admit(engine, 1, n, GenerationConfig(max_new_tokens=m))
        except MemoryBudgetError:
            refused_steps += 1
            continue
        E.step(engine, canvas(model, n, m))
        torch.cuda.synchronize()
        used = device_used() + E.missing_weight_bytes(model)
        worst = max(worst, used, E.counters_peak(engine))
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


def decode_eager(n: int, layers: int = 2, steps: int = 16) -> dict:
    """The Mosaic program (mask-only logits) with PyTorch's allocator for every buffer."""
    from mosaic.runtime.templates import TemplateCache
    model = load("llada-8b", device="cuda", num_layers=layers)
    gen = GenerationConfig(max_new_tokens=1)
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
        E.step(engine, canvas(model, n, m, seed=i))
    torch.cuda.synchronize()
    hist = E.history(engine)
    tpls = [E.template(engine, h.key) for h in hist]
    load_ = max(max(a + b for a, b in zip(t.live_bytes(), t.external)) for t in tpls if t is not None)
    mapped = E.vmm_peak_bytes(engine)
    torch_peak = torch.cuda.max_memory_reserved() - base
    plan_load = max(h.load_bytes for h in hist)
    res = {"tokens": n, "arena": E.arena_kind(engine), "arena_peak_bytes": E.arena_peak_bytes(engine),
           "plan_load_bytes": plan_load, "torch_peak_reserved_bytes": torch_peak, "load_bytes": load_,
           "inflation": (mapped + torch_peak) / load_ - 1,
           "arena_inflation": E.arena_peak_bytes(engine) / plan_load - 1}
    del engine, model
    free()
    return res


def inflation(lengths) -> list[dict]:
    out = []
    for n in lengths:
        rec = {"tokens": n, "arena": decode_arena(n), "caching": decode_eager(n)}
        free()
        with tempfile.TemporaryDirectory() as tmp:   # expandable_segments is fixed at process start
            child = child_record("memory", ["--only", "decode_eager", "--tokens", str(n)], tmp, env=expandable_env())
        rec["expandable"] = child["sections"]["decode_eager"][0] if "sections" in child else child
        out.append(rec)
        print(f"  inflation N={n}: arena {rec['arena']['inflation']:.4f}, caching "
              f"{rec['caching']['inflation']:.4f}, expandable {rec['expandable'].get('inflation')}", flush=True)
    return out


def run(args, rec) -> dict:
    q = args.quick
    lengths = args.tokens or ((8192,) if q else (32768, 131072))
    sections = {
        "vmm_cycles": lambda: vmm_cycles(10 if q else 100),
        "budget_steps": lambda: budget_steps(10 if q else 200, "40GiB", 8192 if q else 49152),
        "budget_tight": lambda: budget_steps(5 if q else 40, "17GiB", 8192 if q else 49152),
        "inflation": lambda: inflation(lengths),
        "decode_eager": lambda: [decode_eager(n) for n in lengths],
    }
    for name in args.only or DEFAULT:
        rec.case(name, sections[name], into="sections")
        free()
    return rec


def table(rec) -> str:
    lines = []
    for name, val in rec.get("sections", {}).items():
        if isinstance(val, dict) and "error" in val:
            lines.append(f"{name:<14} ERROR {val['error'].splitlines()[-1][:100]}")
        elif name == "vmm_cycles":
            lines.append(f"{name:<14} {val['cycles']} cycles, free memory delta {val['free_delta_bytes']} B "
                         f"(within 2 MiB: {val['within_2MiB']}), map {val['map_us_per_handle']:.0f} us/handle")
        elif name.startswith("budget"):
            lines.append(f"{name:<14} {val['steps']} steps, worst {val['worst_device_bytes'] / GiB:.2f} GiB of "
                         f"{val['budget_bytes'] / GiB:.2f} (within: {val['within_budget']}), refusal took "
                         f"{val['refusal_allocated_bytes']} B")
        elif name == "inflation":
            for r in val:
                lines.append(f"{name:<14} N={r['tokens']:>7} arena {r['arena']['inflation']:+.4f} caching "
                             f"{r['caching']['inflation']:+.4f} expandable {r['expandable'].get('inflation')}")
        else:
            for r in val:
                lines.append(f"{name:<14} N={r['tokens']:>7} {r['alloc_conf']} inflation {r['inflation']:+.4f}")
    return "\n".join(lines)
