"""iLLaDA-8B and LLaDA2.x-mini on one H200: block steps vs their byte floor, 1k+256 end to end.

Presets (the published geometry, random weights, bf16), beside LLaDA-8B: the block step of
block diffusion against its weights' byte floor, and end-to-end tokens/s for a 1k prompt + 256
new tokens.

    python -m bench families --out DIR     (a few minutes on one H200)
    # CPU smoke of the suite's code (one layer of each preset, short prompts; not a figure):
    python -m bench families --device cpu --num-layers 1 --prompts 64 --gen 64 --budget none --out DIR

Cases (each in try/except; JSON to OUT/families_gpu.json, a table printed last):
  block    llada2-mini: the first step (prompt + first block, K/V of the prompt stored), a
           block's first step (the finished block refreshed + the block: 2 x 32 rows) and a
           later step (32 rows), at a 1k and an 8k prompt; for each, the experts its rows reach
           per MoE layer (measured by routing), the weight bytes that step must read (every
           non-expert weight + the experts reached) and that floor's time at the H200's HBM
           bandwidth (--hbm-tbs, 4.8 TB/s), and the all-experts byte count beside it
  e2e      1k prompt + 256 tokens: llada2-mini with its published sampler (block 32, 32 steps per
           block, threshold 0.95, and threshold 1.0: the schedule alone), illada-8b and llada-8b
           with LLaDA's exact sampler (block 32, 256 steps): seconds, steps, tokens/s. With random
           weights the threshold rarely fires: the step counts are the schedule's, not a trained
           model's (a trained LLaDA2 commits several tokens per step)
"""

from __future__ import annotations

import json
import time
import traceback

import torch

from bench.lib import engine as E
from bench.lib.measure import free, sync
from bench.lib.record import SuiteError
from mosaic import MosaicEngine, load
from mosaic.config import GenerationConfig
from mosaic.memory.kv_store import KVStore, StoreLayout
from mosaic.models import moe_grouped
from mosaic.models.block_cache import BlockCacheStep, block_step
from mosaic.runtime.block_canvas import block_canvas
from mosaic.runtime.samplers.block_diffusion import BlockReducer

BLOCK = 32


def weight_split(model):
    """(bytes of every non-expert weight, bytes of one expert of one layer, MoE layer count)."""
    total = model.weight_bytes()
    moe = [lw for lw in model.layers if "experts_gate" in lw]
    per_layer = sum(lw[k].numel() * lw[k].element_size() for lw in moe[:1] for k in lw if k.startswith("experts_"))
    E = model.cfg.num_experts
    return total - per_layer * len(moe), per_layer // E, len(moe)


def block_steps(engine, prompt_len, hbm, GEN):
    """Timed block steps of llada2-mini at one prompt length (see the module docstring)."""
    model = engine.model
    cfg, dev = model.cfg, model.device
    canvas = block_canvas([[7] * prompt_len], GEN, BLOCK, cfg.mask_id, cfg.eos_id, dev)
    W = canvas.width
    layout = StoreLayout.of(cfg, 1, W, model.dtype.itemsize)
    store = KVStore(layout, dev, model.dtype)
    gen = GenerationConfig(max_new_tokens=GEN, block_length=BLOCK)
    lo = canvas.first_block(0) * BLOCK
    dense, expert_bytes, moe_layers = weight_split(model)
    out = []
    for name, a, hi in (("first step", 0, lo + BLOCK), ("block's first step", lo, lo + 2 * BLOCK),
                        ("later step", lo + BLOCK, lo + 2 * BLOCK)):
        rows = torch.arange(hi - max(a, hi - BLOCK), device=dev) + max(a, hi - BLOCK) - a   # the block's rows
        spec = BlockCacheStep(a, hi, BLOCK, W, store, layout.device_bytes)
        step = block_step(canvas.ids, canvas.pads, spec, rows=rows, reducer=BlockReducer(gen, None))
        seen = []
        moe_grouped.route_observers.append(lambda t: seen.append(int(torch.unique(t).numel())))
        try:
            store.begin("block", a, W)
            E.execute(engine, step)
            sync(dev)
        finally:
            moe_grouped.route_observers.clear()
        times = []
        for _ in range(5):
            sync(dev)
            t0 = time.perf_counter()
            store.begin("block", a, W)
            E.execute(engine, step)
            sync(dev)
            times.append((time.perf_counter() - t0) * 1e3)
        reached = sum(seen) / max(1, len(seen))
        floor_bytes = dense + int(sum(seen) * expert_bytes)
        all_bytes = dense + expert_bytes * cfg.num_experts * moe_layers
        ms = sorted(times)[len(times) // 2]
        out.append({"prompt": prompt_len, "step": name, "rows": hi - a, "ms": ms,
                    "experts_reached_per_layer": reached, "floor_bytes": floor_bytes, "all_expert_bytes": all_bytes,
                    "floor_ms": floor_bytes / (hbm * 1e12) * 1e3, "x_floor": ms / (floor_bytes / (hbm * 1e12) * 1e3)})
    return out


def e2e(name, opts, args):
    engine = MosaicEngine(load(name, args.device, "bfloat16", num_layers=args.num_layers),
                          {"progress": False, "memory_budget": budget(args)})
    GEN, dev = args.gen, engine.model.device
    prompt = [7 + i % 1000 for i in range(args.prompts[0])]
    engine.generate(prompt, max_new_tokens=32, **{**opts, "steps": 1 if "steps" in opts else None})   # warm
    sync(dev)
    t0 = time.perf_counter()
    out = engine.generate(prompt, max_new_tokens=GEN, **{**opts, "steps": min(opts["steps"], GEN)})
    sync(dev)
    s = time.perf_counter() - t0
    res = {"model": name, "options": opts, "seconds": s, "steps": out.steps, "tokens_per_s": GEN / s,
           "peak_device_bytes": out.peak_device_bytes}
    del engine
    free(dev)
    return res


def budget(args):
    return None if args.budget == "none" else args.budget


def add_arguments(ap):
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run of the code")
    ap.add_argument("--num-layers", type=int, default=None, help="keep the first layers only (smoke runs)")
    ap.add_argument("--prompts", type=int, nargs="*", default=[1024, 8192], help="prompt lengths (e2e: the first)")
    ap.add_argument("--gen", type=int, default=256, help="new tokens")
    ap.add_argument("--budget", default="120GiB", help="memory budget ('none': no budget, for CPU smoke runs)")
    ap.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth for the byte floor (TB/s)")


def output(args) -> str:
    return "families_gpu.json"


def run(args, rec):
    rec["config"] |= {"budget": args.budget, "hbm_tbs": args.hbm_tbs, "block": BLOCK, "gen": args.gen}
    rec["block"], rec["e2e"], rec["errors"] = [], [], []
    GEN = args.gen
    if GEN < 2 * BLOCK:
        raise SuiteError(f"--gen {GEN}: the block part times a block's first and later steps of the second block, "
                         f"so it needs at least {2 * BLOCK} new tokens")
    try:
        model = load("llada2-mini", args.device, "bfloat16", num_layers=args.num_layers)
        engine = MosaicEngine(model, {"progress": False, "memory_budget": budget(args)})
        for P in args.prompts:
            rec["block"] += block_steps(engine, P, args.hbm_tbs, GEN)
        del engine
        free(model.device)
    except Exception:  # noqa: BLE001  (recorded; the other cases still run)
        rec["errors"].append(traceback.format_exc())
    rec.save()
    cases = [("llada2-mini", dict(block_length=BLOCK, steps=32)),
             ("llada2-mini", dict(block_length=BLOCK, steps=32, threshold=1.0)),
             ("illada-8b", dict(block_length=BLOCK, steps=GEN)),
             ("llada-8b", dict(block_length=BLOCK, steps=GEN))]
    for name, opts in cases:
        try:
            rec["e2e"].append(e2e(name, opts, args))
        except Exception:  # noqa: BLE001
            rec["errors"].append(f"{name} {opts}: {traceback.format_exc()}")
        rec.save()
    return rec


def table(rec) -> str:
    lines = [f"{'prompt':>7} {'step':>20} {'rows':>5} {'ms':>8} {'experts/layer':>14} {'floor ms':>9} {'x floor':>8}"]
    for r in rec["block"]:
        lines.append(f"{r['prompt']:>7} {r['step']:>20} {r['rows']:>5} {r['ms']:>8.2f} "
                     f"{r['experts_reached_per_layer']:>14.1f} {r['floor_ms']:>9.3f} {r['x_floor']:>8.1f}")
    lines.append(f"{'model':>12} {'options':>42} {'steps':>6} {'s':>7} {'tok/s':>8}")
    for r in rec["e2e"]:
        lines.append(f"{r['model']:>12} {json.dumps(r['options']):>42} {r['steps']:>6} {r['seconds']:>7.2f} "
                     f"{r['tokens_per_s']:>8.1f}")
    lines += ["error: " + e.strip().splitlines()[-1] for e in rec["errors"]]
    return "\n".join(lines)
