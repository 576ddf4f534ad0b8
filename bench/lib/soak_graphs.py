"""`python -m bench soak --part graphs` (bench/suites/soak.py): the budget holds with captured
steps.

>= 100 random requests with graphs on (the default on a GPU) and an NVML sampler (2 ms) running:
the three presets (llada-8b, dream-7b, llada-moe-7b) depth-truncated to two layers and charged
their full weights, four random budgets each from 18 to 80 GiB, prompts of 256 to 16k tokens,
the exact sampler or a block cache (dual / prefix, threshold 0.9), greedy or sampled (LLaDA at
temperature 0.7, Dream at 0.2 with top_p 0.95, seeded), up to 64 steps; every other request is
repeated at once (its graphs replay across requests). Counted as in the soak part (admitted,
refused, over budget by the driver's counter, out-of-memory errors, the prediction error) and
per request its captured steps (Generation.stats["graphs"]: mode, captures, replays, failures).
~5 minutes on one H200 (--seconds caps it; the JSON is rewritten after every request)."""

from __future__ import annotations

import math
import random

from bench.lib import engine as E
from mosaic import MosaicEngine, load

GiB = 2**30
PRESETS = ("llada-8b", "dream-7b", "llada-moe-7b")
LEVELS_GIB = (18, 19, 20, 22, 24, 28, 32, 40, 48, 64, 80)


def request(rng, family: str, cpu: bool) -> dict:
    """One random request: tokens, canvas, steps and sampler options."""
    n = int(math.exp(rng.uniform(math.log(256), math.log(512 if cpu else 16384))))
    mode = rng.choice(("exact", "dual", "prefix"))
    gen_len = rng.choice((32, 64, 128)) if mode != "exact" else rng.choice((32, 64))
    gen_len = min(gen_len, n // 2 // 32 * 32 or 32)
    block = 32 if gen_len >= 32 else gen_len
    opts = {"block_length": block} if family != "dream" or mode != "exact" else {}
    if mode != "exact":
        opts |= {"cache": mode, "threshold": 0.9}
    if rng.random() < 0.5:
        opts |= {"temperature": 0.2, "top_p": 0.95} if family == "dream" else {"temperature": 0.7}
        opts["seed"] = rng.randrange(1000)
    return {"tokens": n, "gen_len": gen_len, "steps": gen_len, "options": opts, "batch": 1}


def graphs(args, rec, meter, info, run_request, summarize, release_device) -> dict:
    """The part (module docstring); run_request, summarize and release_device: soak.py's."""
    rng = random.Random(args.seed)
    cpu = args.cpu_smoke
    names = ("tiny-llada", "tiny-dream") if cpu else PRESETS
    rec.update(meter=info, part="graphs", rows=[])
    per_family = max(1, args.requests // len(names))
    import time
    t0 = time.perf_counter()
    for idx, name in enumerate(names):
        t_end = t0 + (idx + 1) * args.seconds / len(names)
        model = load(name, device="cpu") if cpu else load(name, device="cuda", num_layers=2)
        missing = E.missing_weight_bytes(model)
        family = model.cfg.family
        budgets = [model.weight_bytes() + (320 + 8 + 64 * k) * 2**20 for k in range(4)] if cpu else \
            sorted(rng.sample([g * GiB for g in LEVELS_GIB], 4))
        for b_i, budget in enumerate(budgets):
            try:
                engine = MosaicEngine(model, {"memory_budget": budget, "progress": False})
            except Exception as e:  # noqa: BLE001
                rec.setdefault("engine_errors", []).append(f"{name} @ {budget}: {e}")
                continue
            for k in range(per_family // len(budgets) + (b_i < per_family % len(budgets))):
                if time.perf_counter() > t_end:
                    break
                req = {"model": name, "budget_bytes": budget, **request(rng, family, cpu)}
                for again in range(1 + (k % 2)):        # every other request twice: replays across requests
                    row = run_request(engine, meter, req, rng, missing, release=False) | {"repeat": again}
                    rec["rows"].append(row)
                rec["summary"] = summary(rec["rows"], summarize)
                rec.save()
            engine.close()
            del engine
            release_device(cpu)
        del model
        release_device(cpu)
    rec["summary"] = summary(rec["rows"], summarize)
    rec.save()
    return rec


def summary(rows: list[dict], summarize) -> dict:
    """The soak's counts and what the graphs did."""
    g = [r.get("graphs") or {} for r in rows if r["status"] == "admitted"]
    return summarize(rows) | {
        "captured_requests": sum(x.get("mode") == "captured" for x in g),
        "eager_requests": sum(x.get("mode") == "eager" for x in g),
        "captures": sum(x.get("captures", 0) for x in g), "replays": sum(x.get("replays", 0) for x in g),
        "capture_failures": sum(x.get("failures", 0) for x in g), "redone": sum(x.get("redone", 0) for x in g),
        "sampled_requests": sum("temperature" in r["options"] for r in rows),
        "cached_requests": sum("cache" in r["options"] for r in rows),
        "eager_notes": sorted({x["note"] for x in g if x.get("note")})[:8]}
