"""The paper's three scenarios on one GPU: long generation, code completion, 128-round chat.

On the llada-8b preset (the real geometry, seeded random weights: latency and memory
depend on shapes, not on the weights' values).

1. code: repository-level code completion, a ~45k-token prompt (45,000 tokens) and a 64-token
   completion in 8 steps (8 tokens a step, one block), Mosaic (planned path) vs the native
   path (the published forward + sampler, full logits) on the same engine; both greedy, so the
   tokens must be identical. 8 steps: every step is a full forward over ~45k tokens (~3 s on an
   H200), so 8 steps keep both runs near half a minute each; the paper reports 18.7 s -> 5.2 s
   for its setting, whose step count it does not restate; per-step times are in the JSON.
2. long: a 100k+-token generation (a 1,024-token prompt + a 100,352-token canvas) under a
   22 GB budget (22e9 bytes: weights 16.0 GB + context + workspace + activations); device
   memory (cudaMemGetInfo, every process) is sampled every 5 ms on a thread and must stay
   under 22e9 bytes. 4 steps (25,088 tokens a step): each step is one forward of 101k tokens.
   Runs first, on a clean device.
3. chat: 128 rounds of chat through `mosaic serve`'s app (in-process uvicorn on 127.0.0.1,
   budget 24 GiB), token-level (the preset has no tokenizer): each round appends a 64-token
   user turn to the history, asks /v1/completions for a 32-token answer (4 steps) and appends
   it; the history keeps its last 4,096 tokens, as chat front-ends truncate. Every round must
   answer 200 (no out-of-memory), and device memory must stay flat once the window is full
   (growth over those rounds <= 64 MiB); per-round device memory is in the JSON.

Run: python -m bench scenarios --out DIR   (about 4-5 minutes on one H200; --quick for a
one-minute smoke run with small sizes; --dry-run: the suite's logic on the CPU with the bundled
model). JSON to DIR/scenarios.json, a table printed last. Each scenario runs in try/except;
--time-limit skips what would not start in time."""

from __future__ import annotations

import os
import time

import torch

from bench.lib import engine as E
from bench.lib.measure import Sampler, device_used, free, process_rss
from bench.lib.record import SuiteError
from mosaic import MosaicEngine, load
from mosaic.errors import MemoryBudgetError
from mosaic.serve.bench import random_prompts

GB, GiB, MiB = 10**9, 2**30, 2**20
FULL = dict(code_prompt=45_000, code_gen=64, code_steps=8, long_prompt=1024, long_gen=100_352, long_steps=4,
            long_budget=22 * GB, chat_rounds=128, chat_user=64, chat_answer=32, chat_steps=4, chat_window=4096,
            chat_budget="24GiB")
# --dry-run: the script's logic on a CPU with the bundled model (no GPU numbers; tests the script)
DRY = dict(code_prompt=48, code_gen=8, code_steps=2, long_prompt=16, long_gen=64, long_steps=2,
           long_budget=None, chat_rounds=6, chat_user=8, chat_answer=8, chat_steps=2, chat_window=40,
           chat_budget=None)
QUICK = dict(code_prompt=8_000, code_gen=32, code_steps=4, long_prompt=1024, long_gen=15_360, long_steps=2,
             long_budget=22 * GB, chat_rounds=12, chat_user=64, chat_answer=32, chat_steps=2, chat_window=512,
             chat_budget="24GiB")


def MemorySampler():
    """Max device bytes in use (every process) sampled every 5 ms on a thread (RSS off a GPU)."""
    return Sampler(0.005)


def used() -> int:
    """Device bytes in use by every process (the process RSS in a --dry-run on a CPU)."""
    return device_used() if torch.cuda.is_available() else process_rss()


def scenario_long(model, s: dict) -> dict:
    """A 100k+-token generation under a 22 GB budget, memory sampled all along."""
    engine = MosaicEngine(model, {"progress": False, "memory_budget": s["long_budget"]})
    if s["long_budget"] is None:   # dry run
        s = s | {"long_budget": E.budget(engine).fixed_bytes + 4 * MiB}
        engine.close()
        engine = MosaicEngine(model, {"progress": False, "memory_budget": s["long_budget"]})
    prompt = random_prompts(engine, 1, s["long_prompt"], seed=1)[0]
    gen_len = s["long_gen"]
    opts = dict(max_new_tokens=gen_len, steps=s["long_steps"])
    out = {"budget_bytes": s["long_budget"], "prompt_tokens": len(prompt), "canvas_tokens": gen_len,
           "steps": s["long_steps"], "before_bytes": used()}
    try:
        adm = E.admit(engine, 1, len(prompt) + gen_len, E.generation_config(engine, **opts))
        out["predicted_bytes"] = adm.predicted_bytes
        out["chunks"] = list(adm.chunks)
    except MemoryBudgetError as e:
        out["refused"] = str(e)
        out["longest_that_fits"] = e.max_tokens
        gen_len = (e.max_tokens - len(prompt)) // 1024 * 1024
        opts["max_new_tokens"] = gen_len
        out["canvas_tokens"] = gen_len
    with MemorySampler() as mem:
        r = engine.generate([prompt], progress=False, **opts)
    out |= {"seconds": r.seconds, "ms_per_step": 1e3 * r.seconds / r.steps, "path": r.path,
            "total_tokens": len(prompt) + gen_len, "device_max_bytes": mem.max_bytes, "samples": mem.samples,
            "engine_peak_bytes": r.peak_device_bytes, "under_22GB": mem.max_bytes < 22 * GB,
            "under_budget": mem.max_bytes <= s["long_budget"],
            "chunks_run": E.last_chunks(engine)}
    engine.close()   # the arena's pages back now, before the next scenario
    del engine, r
    free()
    return out


def scenario_code(model, s: dict) -> dict:
    """~45k-token prompt, short completion: native vs Mosaic latency, same tokens."""
    engine = MosaicEngine(model, {"progress": False})
    prompt = random_prompts(engine, 1, s["code_prompt"], seed=2)[0]
    opts = dict(max_new_tokens=s["code_gen"], steps=s["code_steps"])
    out = {"prompt_tokens": len(prompt), "canvas_tokens": s["code_gen"], "steps": s["code_steps"]}
    runs = {}
    for label, native in (("mosaic", False), ("native", True)):
        try:
            engine.generate([prompt], native=native, progress=False, max_new_tokens=s["code_gen"], steps=1)  # warm-up
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            r = engine.generate([prompt], native=native, progress=False, **opts)
            runs[label] = r
            out[label] = {"seconds": r.seconds, "ms_per_step": 1e3 * r.seconds / r.steps,
                          "peak_bytes": r.peak_device_bytes, "path": r.path}
        except Exception as e:   # the native path's full logits may not fit: say so
            out[label] = {"error": f"{type(e).__name__}: {e}"[:500]}
        free()
    if len(runs) == 2:
        out["speedup"] = runs["native"].seconds / runs["mosaic"].seconds
        out["same_tokens"] = bool(torch.equal(runs["native"].tokens, runs["mosaic"].tokens))
    out["paper_seconds"] = {"native": 18.7, "mosaic": 5.2}
    engine.close()   # the arena's pages back now, before the next scenario
    del engine, runs
    free()
    return out


def scenario_chat(model, s: dict) -> dict:
    """128 rounds through the HTTP server; per-round device memory; flat once the window is full."""
    import httpx

    from mosaic.serve.server import ServerThread
    engine = MosaicEngine(model, {"progress": False, "memory_budget": s["chat_budget"]})
    user_turns = random_prompts(engine, s["chat_rounds"], s["chat_user"], seed=3)
    history: list[int] = []
    rounds = []
    t0 = time.perf_counter()
    with ServerThread(engine, timeout=120, max_model_len=s["chat_window"]) as srv, \
            httpx.Client(base_url=srv.url, timeout=600) as c, \
            MemorySampler() as mem:
        for i, turn in enumerate(user_turns):
            history = (history + turn)[-(s["chat_window"] - s["chat_answer"]):]
            t = time.perf_counter()
            r = c.post("/v1/completions", json={"prompt": history, "max_tokens": s["chat_answer"],
                                                "steps": s["chat_steps"], "return_token_ids": True})
            rec = {"round": i + 1, "status": r.status_code, "prompt_tokens": len(history),
                   "seconds": time.perf_counter() - t, "device_used_bytes": used()}
            rep = engine.memory_report()
            rec |= {"torch_reserved_bytes": rep.get("torch_reserved_bytes"),
                    "arena_mapped_bytes": rep.get("arena_mapped_bytes")}
            if r.status_code == 200:
                body = r.json()
                rec["engine_seconds"] = body["mosaic"]["engine_seconds"]
                rec["server_seconds"] = body["mosaic"].get("server_seconds")   # handler time outside queue + engine
                history = history + body["mosaic"]["token_ids"]   # the answer, up to end-of-text
            else:
                rec["error"] = r.text[:300]
            rounds.append(rec)
        metrics = c.get("/metrics").text
    ok = [r for r in rounds if r["status"] == 200]
    full_from = next((r["round"] for r in rounds if r["prompt_tokens"] >= s["chat_window"] - s["chat_answer"] - 1),
                     None)
    flat = [r["device_used_bytes"] for r in rounds if full_from and r["round"] >= full_from]
    share = sorted(r["server_seconds"] / r["engine_seconds"] for r in ok
                   if r.get("server_seconds") is not None and r["engine_seconds"] > 0)
    out = {"rounds": len(rounds), "answered": len(ok), "budget": s["chat_budget"], "window_tokens": s["chat_window"],
           "server_share_of_engine_p50": share[len(share) // 2] if share else None,
           "seconds": time.perf_counter() - t0, "device_max_bytes": mem.max_bytes,
           "window_full_from_round": full_from,
           "growth_after_window_bytes": (max(flat) - flat[0]) if flat else None,
           "flat": bool(flat) and max(flat) - flat[0] <= 64 * MiB,
           "first_round_bytes": rounds[0]["device_used_bytes"], "last_round_bytes": rounds[-1]["device_used_bytes"],
           "metrics_oom_free": "out of memory" not in metrics.lower(), "per_round": rounds}
    engine.close()   # the arena's pages back now, before the next scenario
    del engine
    free()
    return out


def add_arguments(ap):
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run of about a minute")
    ap.add_argument("--only", nargs="*", choices=["long", "code", "chat"])
    ap.add_argument("--dry-run", action="store_true", help="CPU, bundled tiny-llada, tiny sizes: checks the suite")
    ap.add_argument("--time-limit", type=float, default=540, help="seconds; later scenarios are skipped past it")


def run(args, rec) -> dict:
    if not torch.cuda.is_available() and not args.dry_run:
        raise SuiteError("the scenarios suite needs a CUDA GPU (--dry-run checks it on a CPU)")
    os.environ.setdefault("TQDM_DISABLE", "1")
    s = DRY if args.dry_run else QUICK if args.quick else FULL
    rec.update(sizes=s, scenarios={})
    t0 = time.perf_counter()
    model = load("tiny-llada", device="cpu") if args.dry_run else load("llada-8b", device="cuda")
    rec["load_seconds"] = time.perf_counter() - t0
    rec["weights_bytes"] = model.weight_bytes()
    # long first: its memory is measured on a device holding only the weights and the context
    for name, fn in (("long", scenario_long), ("code", scenario_code), ("chat", scenario_chat)):
        if args.only and name not in args.only:
            continue
        if time.perf_counter() - t0 > args.time_limit:
            rec["scenarios"][name] = {"skipped": f"past --time-limit {args.time_limit} s"}
            continue
        print(f"[{time.perf_counter() - t0:6.1f} s] scenario {name}", flush=True)
        try:
            rec["scenarios"][name] = fn(model, s)
        except Exception as e:  # noqa: BLE001  (recorded; the next scenario still runs)
            rec["scenarios"][name] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        free()
        rec.save()
    return rec


def table(rec: dict) -> str:
    """One line per scenario that ran: its result and check, or why it did not run."""
    rows = {"long": _long_row, "code": _code_row, "chat": _chat_row}
    lines = [f"{'scenario':<8} {'result':<72} {'check':>6}"]
    for name, r in rec["scenarios"].items():
        if "error" in r or "skipped" in r:
            lines.append(f"{name:<8} {r.get('error') or r.get('skipped'):<72.72}")
        elif name in rows:
            lines.append(f"{name:<8} {rows[name](r)}")
    return "\n".join(lines)


def _long_row(r: dict) -> str:
    return (f"{r['total_tokens']:,} tokens, {r['steps']} steps in {r['seconds']:.1f} s, "
            f"device max {r['device_max_bytes'] / GB:.2f} GB (budget {r['budget_bytes'] / GB:.0f} GB)"
            f"{'':<4} {'ok' if r['under_22GB'] else 'OVER':>6}")


def _code_row(r: dict) -> str:
    m, n = r.get("mosaic", {}), r.get("native", {})
    ms = f"{m['seconds']:.1f} s" if "seconds" in m else "failed"
    ns = f"{n['seconds']:.1f} s" if "seconds" in n else "failed"
    sp = f", x{r['speedup']:.2f}" if "speedup" in r else ""
    return (f"{r['prompt_tokens']:,}-token prompt, {r['steps']} steps: native {ns} -> "
            f"Mosaic {ms}{sp} (paper 18.7 -> 5.2 s)  {'same' if r.get('same_tokens') else 'DIFF':>6}")


def _chat_row(r: dict) -> str:
    g, share = r["growth_after_window_bytes"], r.get("server_share_of_engine_p50") or 0
    good = r["flat"] and r["answered"] == r["rounds"]
    return (f"{r['answered']}/{r['rounds']} rounds answered in {r['seconds']:.0f} s, device "
            f"{r['first_round_bytes'] / GB:.2f} -> {r['last_round_bytes'] / GB:.2f} GB, growth after "
            f"window {(g or 0) / MiB:.0f} MiB, server p50 {100 * share:.1f}% "
            f"of engine {'ok' if good else 'NO':>6}")

