"""A real load test of `mosaic serve`: concurrency 1/4/16/64 over loopback, TTFT and latency.

    python -m bench serve_load --out DIR                       # GPU: llada-8b preset, dual cache
    python -m bench serve_load --cpu --requests 6 --out DIR    # CPU: the bundled tiny-llada (CI-sized)
    python -m bench serve_load --prompt-dist fixed --prompt-mean 1024 --max-tokens 128 --out DIR
        # every prompt 1,024 tokens: comparable with `everyday --part batch` (generate() batches)

The server runs in this process (uvicorn on a thread, the engine's continuous batch behind it);
each concurrency level runs `--requests` streaming /v1/completions requests per client slot over
httpx, with prompt lengths drawn from a ShareGPT-like distribution generated here (log-normal,
median ~1/3 of `--prompt-mean`, clipped; no data set can be downloaded) and `--max-tokens` new
tokens each (`--prompt-dist fixed`: every prompt `--prompt-mean` tokens). Per level: requests/s,
output tok/s (the canvas tokens of completed requests), TTFT (first streamed text) and latency
p50/p95/p99, refusals with their reasons, the driver's memory peak (NVML or cudaMemGetInfo,
sampled every 2 ms; the process RSS on a CPU) against the budget, and the Scheduler's rounds:
ms per round beside the linear layers' compute floor for the tokens a round ran (2 x the
layer weights x tokens at the matrix rate measured here: a lower bound, attention and logits
left out). The server's own time is latency minus the engine time the response reports.
`--round-tokens` is the server's chunked-joining budget (mosaic serve's default; 0: fills whole)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import statistics
import time

import httpx
import torch

from bench.lib.batched import linear_flops
from bench.lib.floors import matmul_rate
from bench.lib.measure import meter, process_rss
from mosaic import MosaicEngine
from mosaic.serve.commands import SERVE_ROUND_TOKENS

LEVELS = (1, 4, 16, 64)


def add_arguments(ap):
    ap.add_argument("--cpu", action="store_true", help="the bundled tiny-llada on the CPU (bounded, CI-sized)")
    ap.add_argument("--model", default=None, help="default: llada-8b (GPU) or tiny-llada (--cpu)")
    ap.add_argument("--levels", type=int, nargs="*", default=None, help=f"concurrency levels (default {LEVELS})")
    ap.add_argument("--requests", type=int, default=4, help="requests per client slot at each level")
    ap.add_argument("--prompt-mean", type=int, default=1024, help="mean prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--budget", default=None,
                    help="engine memory budget (default: 120GiB on the GPU; 'none': no budget, as generate() "
                         "runs by default: batched block steps over the paged pool, captured)")
    ap.add_argument("--options", default='{"cache": "dual", "threshold": 0.9, "block_length": 32}',
                    help="JSON of extra request fields (sampler options)")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--prompt-dist", choices=("lognormal", "fixed"), default="lognormal",
                    help="prompt lengths: ShareGPT-like (log-normal) or every one --prompt-mean tokens")
    ap.add_argument("--warm", action="store_true",
                    help="run each level once unmeasured first (one request per slot): the steady state, "
                         "its captures made")
    ap.add_argument("--peer", action="store_true",
                    help="after the server, the same engine's generate() of each level's batch of prompts "
                         "(--prompt-dist fixed only): the engine's own throughput, measured in the same run")
    ap.add_argument("--round-tokens", type=int, default=SERVE_ROUND_TOKENS,
                    help="chunked joining: tokens a round runs before fills are sliced (0: fills run whole)")


def output(args) -> str:
    return "serve_load_cpu.json" if args.cpu else "serve_load.json"


def prompt_lengths(n: int, mean: int, seed: int = 0) -> list[int]:
    """ShareGPT-like prompt lengths: log-normal (sigma 1), scaled to `mean`, within [8, 4 x mean]."""
    rng = random.Random(seed)
    raw = [rng.lognormvariate(0.0, 1.0) for _ in range(n)]
    scale = mean / statistics.fmean(raw)
    return [max(8, min(4 * mean, round(r * scale))) for r in raw]


async def one(client, url, ids, max_tokens, opts) -> dict:
    t0 = time.perf_counter()
    body = {"prompt": ids, "max_tokens": max_tokens, "stream": True, **opts}   # the canvas is always max_tokens
    first, engine_s, queue_s, err = None, None, 0.0, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode()
            return {"status": r.status_code, "error": text[:300], "latency_s": time.perf_counter() - t0}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                err = chunk["error"]
            if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                first = time.perf_counter() - t0
            extra = chunk.get("mosaic") or {}
            engine_s = extra.get("engine_seconds", engine_s)
            queue_s = extra.get("queue_seconds", queue_s)
    return {"status": 200 if err is None else 500, "error": err, "ttft_s": first,
            "latency_s": time.perf_counter() - t0, "engine_s": engine_s, "queue_s": queue_s}


async def level(url, concurrency: int, per_slot: int, lengths, allowed: list[int], max_tokens: int,
                opts) -> list[dict]:
    rng = random.Random(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def slot(s):
            out = []
            for j in range(per_slot):
                n = lengths[(s * per_slot + j) % len(lengths)]
                ids = [rng.choice(allowed) for _ in range(n)]
                out.append(await one(client, url, ids, max_tokens, opts))
            return out
        res = await asyncio.gather(*(slot(s) for s in range(concurrency)))
    return [r for rs in res for r in rs]


def level_stats(before, after) -> dict:
    """The round executor's counters of one level (after minus before: they add up over levels)."""
    diff = dataclasses.replace(after, **{f.name: getattr(after, f.name) - getattr(before, f.name)
                                         for f in dataclasses.fields(after) if f.name != "fallbacks"},
                               fallbacks=after.fallbacks[len(before.fallbacks):])
    return diff.as_dict() | {"fallbacks": diff.fallbacks[:5]}


def graph_stats(engine) -> dict | None:
    """The engine's captured-step counters so far (None: no CUDA graphs), the first failures."""
    if engine.graphs is None:
        return None
    d = engine.graphs.stats.as_dict()
    return d | {"failures": d["failures"][:3], "num_failures": len(d["failures"])}


def pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else None


def run(args, rec):
    from mosaic.serve.server import ServerThread
    cpu = args.cpu or not torch.cuda.is_available()
    name = args.model or ("tiny-llada" if cpu else "llada-8b")
    levels = args.levels or ((1, 4) if cpu else LEVELS)
    cfg = {"progress": False, "device": "cpu" if cpu else "cuda", "round_tokens": args.round_tokens or None}
    if args.budget != "none" and (args.budget or not cpu):
        cfg["memory_budget"] = args.budget or "120GiB"
    engine = MosaicEngine(name, cfg)
    opts = json.loads(args.options)
    if cpu and "block_length" in opts:
        opts["block_length"] = min(opts["block_length"], args.max_tokens)
    mc = engine.model.cfg
    specials = {mc.mask_id, mc.eos_id, mc.bos_id, mc.pad_id, mc.eot_id, *mc.extra_eos_ids}
    allowed = [t for t in range(3, min(mc.vocab, 30000)) if t not in specials]   # plain text ids
    rec["config"] |= {"model": name, "levels": list(levels), "requests_per_slot": args.requests,
                      "prompt_mean": args.prompt_mean, "max_tokens": args.max_tokens, "options": opts,
                      "max_batch": args.max_batch, "budget_bytes": engine.budget.budget_bytes,
                      "prompt_dist": args.prompt_dist, "round_tokens": args.round_tokens or None}
    rec["levels"] = []
    lengths = prompt_lengths(256, args.prompt_mean) if args.prompt_dist == "lognormal" else [args.prompt_mean]
    rate = None if cpu else matmul_rate() * 1e12     # bf16 8192^3 torch.mm, FLOP/s
    rec["config"]["matrix_flops_per_s"] = rate
    # the mix's longest request is served even past the trained length (the load, not the length rule)
    longest = max(mc.max_seq_len, max(lengths) + args.max_tokens)
    with ServerThread(engine, max_batch=args.max_batch, request_timeout=None, max_model_len=longest) as srv:
        for c in levels:
            m = meter(baseline=False) if not cpu else None
            rss0 = process_rss()
            sched = srv.app.state.server.worker.scheduler
            if args.warm:
                asyncio.run(level(srv.url, c, 1, lengths, allowed, args.max_tokens, opts))
            batch0 = dataclasses.replace(sched.stats)
            rounds0, secs0, toks0 = sched.rounds, sched.round_seconds, sched.round_tokens_run
            t0 = time.perf_counter()
            if m is not None:
                m.start()
            rows = asyncio.run(level(srv.url, c, args.requests, lengths, allowed, args.max_tokens, opts))
            wall = time.perf_counter() - t0
            if m is not None:
                m.stop()
            ok = [r for r in rows if r["status"] == 200]
            lat = [r["latency_s"] for r in ok]
            server_share = [(r["latency_s"] - r["engine_s"] - r["queue_s"]) / r["engine_s"] for r in ok
                            if r.get("engine_s")]
            rounds = max(1, sched.rounds - rounds0)
            per_round = (sched.round_tokens_run - toks0) / rounds
            floor_ms = 1e3 * linear_flops(engine.model.cfg, per_round) / rate if rate else None
            peak = m.peak_bytes if m is not None else max(rss0, process_rss())
            row = {"concurrency": c, "requests": len(rows), "completed": len(ok), "wall_s": wall,
                   "requests_per_s": len(ok) / wall, "output_tok_per_s": len(ok) * args.max_tokens / wall,
                   "ttft_p50_s": pct([r.get("ttft_s") for r in ok], 0.5),
                   "ttft_p95_s": pct([r.get("ttft_s") for r in ok], 0.95),
                   "ttft_p99_s": pct([r.get("ttft_s") for r in ok], 0.99),
                   "latency_p50_s": pct(lat, 0.5), "latency_p95_s": pct(lat, 0.95), "latency_p99_s": pct(lat, 0.99),
                   "refusals": [r["error"] for r in rows if r["status"] != 200][:10],
                   "server_over_engine_p50": pct(server_share, 0.5),
                   "peak_bytes": peak, "budget_bytes": engine.budget.budget_bytes,
                   "peak_within_budget": engine.budget.budget_bytes is None or peak <= engine.budget.budget_bytes,
                   "rounds": rounds, "ms_per_round": 1e3 * (sched.round_seconds - secs0) / rounds,
                   "tokens_per_round": per_round,
                   "linear_floor_ms_per_round": floor_ms,
                   "batch": level_stats(batch0, sched.stats),
                   "graphs": graph_stats(engine)}
            rec["levels"].append(row)
            rec.save()
            print(json.dumps(row), flush=True)
    if args.peer and args.prompt_dist == "fixed":
        for row in rec["levels"]:
            row["engine"] = peer(engine, row["concurrency"], args.prompt_mean, args.max_tokens, allowed, opts)
            row["served_over_engine"] = row["output_tok_per_s"] / row["engine"]["tok_per_s"]
            rec.save()
            print(json.dumps({"concurrency": row["concurrency"], **row["engine"],
                              "served_over_engine": row["served_over_engine"]}), flush=True)
    base = rec["levels"][0]["output_tok_per_s"] if rec["levels"] else None
    for row in rec["levels"]:
        row["speedup_vs_first"] = row["output_tok_per_s"] / base if base else None
    engine.close()
    return rec


def peer(engine, c: int, prompt: int, max_tokens: int, allowed, opts) -> dict:
    """The engine's generate() of c prompts of `prompt` tokens (the served level's batch, same
    engine and budget, no server): once to capture, then timed; tok/s of the canvas tokens."""
    rng = random.Random(c)
    prompts = [[rng.choice(allowed) for _ in range(prompt)] for _ in range(c)]
    kw = {"max_new_tokens": max_tokens, **opts}        # as the server maps a request of max_tokens
    engine.generate(prompts, **kw)
    t0 = time.perf_counter()
    out = engine.generate(prompts, **kw)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tok_per_s": c * max_tokens / wall, "graphs": (out.stats.get("graphs") or {}).get("mode")}


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(rec) -> str:
    lines = [f"{'conc':>4} {'done':>5} {'req/s':>7} {'tok/s':>8} {'x c=1':>6} {'TTFT p50':>9} {'p99':>6} "
             f"{'lat p50':>8} {'p95':>7} {'p99':>7} {'refused':>7} {'peak GiB':>8} {'ms/round':>8} {'floor':>6} "
             f"{'/gen':>5}"]
    for r in rec.get("levels", []):
        floor = r.get("linear_floor_ms_per_round")
        lines.append(f"{r['concurrency']:>4} {r['completed']:>5} {r['requests_per_s']:>7.2f} "
                     f"{r['output_tok_per_s']:>8.1f} {r.get('speedup_vs_first') or 0:>6.2f} "
                     f"{r['ttft_p50_s'] or 0:>9.2f} {r.get('ttft_p99_s') or 0:>6.2f} {r['latency_p50_s'] or 0:>8.2f} "
                     f"{r['latency_p95_s'] or 0:>7.2f} {r['latency_p99_s'] or 0:>7.2f} {len(r['refusals']):>7} "
                     f"{r['peak_bytes'] / 2**30:>8.2f} {r.get('ms_per_round') or 0:>8.1f} "
                     f"{f'{floor:.1f}' if floor else '-':>6} {_ratio(r.get('served_over_engine')):>5}")
    return "\n".join(lines)
