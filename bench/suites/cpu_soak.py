"""Bounded state on the CPU: many requests through one engine, the process's RSS sampled.

    python -m bench cpu_soak --requests 10000 --out DIR      # ~10-20 min on 2 busy cores

One MosaicEngine over the bundled tiny-llada (and tiny-dream with --models), --requests
generate() calls cycling through a mix: held-out prompts of mosaic/assets/tasks.py, batches of 1-3
prompts, 2-8 new tokens, the exact sampler, the dual cache with a threshold, self-speculative
decoding, an early stop, and a refused request (a bad option) every 50th call. The RSS
(/proc/self/statm, resident pages) is sampled every --every requests after a warm-up of
--warmup requests; the record holds the samples, engine.history's length and the growth over the
measured part: the target "10,000-request soak with RSS flat".
"""

from __future__ import annotations

import gc
import random
import time

from bench.lib.measure import process_rss
from mosaic import InputError, MosaicEngine, load
from mosaic.assets import tasks

MIX = [
    dict(max_new_tokens=8, steps=8),
    dict(max_new_tokens=4, steps=4),
    dict(max_new_tokens=8, steps=8, cache="dual", block_length=4, threshold=0.9),
    dict(max_new_tokens=8, steps=8, speculate=4),
    dict(max_new_tokens=2, steps=2),
]


def add_arguments(ap):
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200, help="requests before the first RSS sample that counts")
    ap.add_argument("--every", type=int, default=100, help="requests between RSS samples")
    ap.add_argument("--models", nargs="*", default=["tiny-llada"])
    ap.add_argument("--seed", type=int, default=0)


def soak(name: str, args) -> dict:
    rng = random.Random(args.seed)
    prompts = tasks.held_out(5)
    eng = MosaicEngine(load(name), {"progress": False, "threads": 1})
    samples, refused, stopped, t0 = [], 0, 0, time.perf_counter()
    for i in range(args.requests):
        opts = dict(MIX[i % len(MIX)])
        batch = [rng.choice(prompts) for _ in range(1 + i % 3)]
        if eng.model.cfg.family != "llada" and "cache" in opts:
            opts.pop("threshold")
        try:
            if i % 50 == 49:
                eng.generate(batch, max_new_tokens=-1)
            elif i % 7 == 3:
                stopped += eng.generate(batch, on_step=lambda s, x: s >= 2, **opts).stopped_early
            else:
                eng.generate(batch, **opts)
        except InputError:
            refused += 1
        if i + 1 >= args.warmup and (i + 1 - args.warmup) % args.every == 0:
            gc.collect()
            samples.append({"requests": i + 1, "rss_bytes": process_rss(), "history": len(eng.history),
                            "seconds": time.perf_counter() - t0})
    eng.close()
    first, last = samples[0], samples[-1]
    half = samples[len(samples) // 2]
    return {"model": name, "requests": args.requests, "refused": refused, "stopped_early": stopped,
            "samples": samples, "rss_growth_bytes": last["rss_bytes"] - first["rss_bytes"],
            "rss_growth_second_half_bytes": last["rss_bytes"] - half["rss_bytes"],
            "history_max": max(s["history"] for s in samples), "seconds": time.perf_counter() - t0}


def run(args, rec):
    for name in args.models:
        rec.case(name, lambda name=name: soak(name, args))
    return rec


def table(rec) -> str:
    lines = []
    for name in rec["config"]["models"]:
        r = rec.get(name)
        if not r or "error" in r:
            lines.append(f"{name}: {r and r.get('error')}")
            continue
        mib = 2 ** 20
        lines.append(f"{name}: {r['requests']:,} requests in {r['seconds']:.0f} s ({r['refused']} refused, "
                     f"{r['stopped_early']} stopped early); RSS {r['samples'][0]['rss_bytes'] / mib:.1f} -> "
                     f"{r['samples'][-1]['rss_bytes'] / mib:.1f} MiB (growth {r['rss_growth_bytes'] / mib:+.1f} MiB, "
                     f"second half {r['rss_growth_second_half_bytes'] / mib:+.1f} MiB); history at most "
                     f"{r['history_max']}")
    return "\n".join(lines)
