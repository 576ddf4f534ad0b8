"""`mosaic bench`: latency, throughput and capacity of a model under a budget, in one command.

latency: `runs` generations of one prompt (after `warmup`), p50 / p90 / mean seconds, ms per
step and canvas tokens per second. throughput: one generate() of `batch_size` prompts of the
same length (a batch of requests run together by the engine's Scheduler; tokens per second over
all of them). capacity: the
longest prompt + output the budget admits for these sampler options (none without a budget).
Prompts are seeded random token ids (special ids excluded), so every model can be measured,
preset weights included. Presets name a model and sizes; explicit options override them."""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import time

import torch

from ..config import EngineConfig, name_defaults
from ..engine import MosaicEngine
from ..errors import InputError, gib
from .capacity import capacity_tokens

CANVAS_WORDS = re.compile(r"\b(gen_length|max_new_tokens)\b")   # the engine's names of what --output-len sets
# name -> defaults (any bench option); "cpu" runs in seconds on 2 cores with the bundled model
PRESETS = {
    "cpu": dict(model="tiny-llada", input_len=16, output_len=8, steps=8, batch_size=4, runs=5, warmup=1),
    "llada-8b-4k": dict(model="llada-8b", input_len=3840, output_len=256, steps=32, block_length=32,
                        batch_size=4, runs=3, warmup=1, budget="40GiB"),
    "llada-8b-32k": dict(model="llada-8b", input_len=32256, output_len=512, steps=8, block_length=64,
                         batch_size=1, runs=2, warmup=1, budget="40GiB"),
    "dream-7b-4k": dict(model="dream-7b", input_len=3840, output_len=256, steps=32, batch_size=4, runs=3,
                        warmup=1, budget="40GiB"),
    "llada-moe-7b-4k": dict(model="llada-moe-7b", input_len=3840, output_len=256, steps=32, block_length=32,
                            batch_size=4, runs=3, warmup=1, budget="40GiB"),
}
DEFAULTS = dict(model="tiny-llada", input_len=16, output_len=8, steps=None, block_length=None, batch_size=1,
                runs=3, warmup=1, budget=None, seed=0)


def settings(preset: str | None, **given) -> dict:
    """Defaults < preset < explicit options (None = not given)."""
    if preset is not None and preset not in PRESETS:
        raise InputError(f"unknown bench preset {preset!r}; presets: {sorted(PRESETS)}")
    out = dict(DEFAULTS) | (PRESETS[preset] if preset else {})
    return out | {k: v for k, v in given.items() if v is not None}


def random_prompts(engine: MosaicEngine, batch: int, length: int, seed: int) -> list[list[int]]:
    """batch x length token ids drawn uniformly from the vocabulary minus the special ids."""
    cfg = engine.model.cfg
    special = {i for i in (cfg.mask_id, cfg.eos_id, cfg.bos_id, cfg.eot_id, cfg.pad_id) if i is not None}
    allowed = torch.tensor([i for i in range(min(cfg.vocab, 1 << 20)) if i not in special])
    g = torch.Generator().manual_seed(seed)
    return allowed[torch.randint(len(allowed), (batch, length), generator=g)].tolist()


def run_bench(engine: MosaicEngine, s: dict) -> dict:
    """The measurements of one configuration `s` (settings()) as a JSON-ready dict."""
    opts = {"max_new_tokens": s["output_len"], "steps": s["steps"], "block_length": s["block_length"]}
    gen = engine.generation_config(**{k: v for k, v in opts.items() if v is not None})
    gen = dataclasses.replace(gen, seed=s["seed"])
    prompts = random_prompts(engine, max(1, s["batch_size"]), s["input_len"], s["seed"])
    steps = engine.sampler.total_steps(gen)
    G = gen.max_new_tokens
    out = {"model": engine.model.name, "device": str(engine.model.device),
           "path": "native" if engine.config.native else "planned", "budget_bytes": engine.budget.budget_bytes,
           "input_len": s["input_len"], "output_len": G, "steps": steps, "block_length": gen.block_length}
    t0 = time.perf_counter()
    out["capacity_tokens"] = capacity_tokens(engine, gen)
    out["capacity_seconds"] = time.perf_counter() - t0
    for _ in range(s["warmup"]):
        engine.generate([prompts[0]], config=gen, progress=False)
    times, peak, r = [], 0, None
    for _ in range(s["runs"]):
        r = engine.generate([prompts[0]], config=gen, progress=False)
        times.append(r.seconds)
        peak = max(peak, r.peak_device_bytes)
    out["latency"] = {"runs": len(times), "p50_s": statistics.median(times), "p90_s": _quantile(times, 0.9),
                      "mean_s": statistics.fmean(times), "ms_per_step": 1e3 * statistics.median(times) / steps,
                      "canvas_tokens_per_s": G / statistics.median(times), "peak_bytes": peak,
                      "predicted_bytes": r.predicted_bytes if r is not None else None}
    B = len(prompts)
    r = engine.generate(prompts, config=gen, progress=False)
    out["throughput"] = {"batch_size": B, "seconds": r.seconds, "canvas_tokens_per_s": B * G / r.seconds,
                         "sequence_tokens_per_s": B * (s["input_len"] + G) * steps / r.seconds,
                         "peak_bytes": r.peak_device_bytes}
    out["peak_label"] = "device memory peak" if engine.model.device.type == "cuda" else "process RSS peak"
    return out


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def table(rec: dict) -> str:
    lat, thr = rec["latency"], rec["throughput"]
    cap = rec["capacity_tokens"]
    budget = gib(rec["budget_bytes"]) if rec["budget_bytes"] else "none"
    lines = [
        f"{rec['model']} on {rec['device']} ({rec['path']}), budget {budget}: prompt {rec['input_len']:,} + "
        f"canvas {rec['output_len']:,} tokens, {rec['steps']} steps",
        f"  latency     p50 {lat['p50_s']:.3f} s  p90 {lat['p90_s']:.3f} s  {lat['ms_per_step']:.1f} ms/step  "
        f"{lat['canvas_tokens_per_s']:.1f} canvas tok/s  ({rec['peak_label']} {gib(lat['peak_bytes'])})",
        f"  throughput  batch {thr['batch_size']}: {thr['canvas_tokens_per_s']:.1f} canvas tok/s, "
        f"{thr['sequence_tokens_per_s']:.0f} token-steps/s in {thr['seconds']:.3f} s",
        f"  capacity    {f'{cap:,} tokens (prompt + canvas)' if cap else 'unbounded (no budget)'}"
        f"  [{rec['capacity_seconds']:.2f} s to find]",
    ]
    return "\n".join(lines)


def bench_main(args, econf: EngineConfig) -> int:
    """CLI entry (commands.py): prints the table, or one JSON object with --json."""
    s = settings(args.preset, model=args.model, input_len=args.input_len, output_len=args.output_len,
                 steps=args.steps, block_length=args.block_length, batch_size=args.batch_size, runs=args.runs,
                 warmup=args.warmup, budget=args.memory_budget, seed=args.seed)
    econf = dataclasses.replace(econf, memory_budget=s["budget"])
    engine = MosaicEngine(s["model"], econf)
    try:
        rec = run_bench(engine, s) | {"preset": args.preset, "settings": s}
    except InputError as e:   # in bench's words: the canvas is --output-len; a value no flag set is the file's
        given = {"max_new_tokens": s["output_len"], "steps": s["steps"], "block_length": s["block_length"]}
        text = name_defaults(str(e), given, engine.model.generation_defaults)
        raise InputError(CANVAS_WORDS.sub("--output-len", text), param=e.param) from None
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
    print(json.dumps(rec) if args.json else table(rec))
    return 0
