"""Chunked joining: the running requests' rounds while a long prompt joins, fills whole vs sliced.

    python -m bench join --out DIR          # GPU: llada-8b preset, 16 requests at 1k + 128, an 8k prompt joins
    python -m bench join --cpu --out DIR    # CPU: bundled tiny-llada, 4 requests, a 2k-token prompt joins

`--decoders` requests (dual cache, threshold 0.9, block 32, `--prompt` tokens + 128) run in one
Scheduler (engine/scheduler.py); after `--warm` rounds a newcomer with a `--join-prompt`-token
prompt joins. Its first forward fills its block cache: the whole prompt through every layer.
Per setting (fills whole, then each `--round-tokens` value): every round from the join until the
newcomer's first denoising step is done (the most and the median wall time: how long the running
requests waited for a round while it joined), the newcomer's time to its first step (its fill
and first block step: the TTFT a server would see after admission), and whether every request's
tokens equal those of the run with whole fills (the slices compute the same K/V)."""

from __future__ import annotations

import json
import statistics
import time

import torch

from bench.lib.measure import canvas
from mosaic import MosaicEngine, load
from mosaic.engine.scheduler import Scheduler

OPTS = dict(max_new_tokens=128, block_length=32, steps=128, cache="dual", threshold=0.9)


def add_arguments(ap):
    ap.add_argument("--cpu", action="store_true", help="the bundled tiny-llada on the CPU")
    ap.add_argument("--model", default=None, help="default: llada-8b (GPU) or tiny-llada (--cpu)")
    ap.add_argument("--decoders", type=int, default=None, help="requests running when the newcomer joins")
    ap.add_argument("--prompt", type=int, default=None, help="their prompt tokens")
    ap.add_argument("--join-prompt", type=int, default=None, help="the newcomer's prompt tokens")
    ap.add_argument("--warm", type=int, default=6, help="rounds before the newcomer joins")
    ap.add_argument("--round-tokens", type=int, nargs="*", default=None,
                    help="round budgets to compare with whole fills (default: 2048 and 1024)")


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _ids(model, n: int, seed: int) -> list[int]:
    ids = canvas(model, n, 0, seed=seed)[0].tolist()
    return [t for t in ids if t != model.cfg.mask_id][:n]


def one_setting(eng, prompts, newcomer, round_tokens, warm) -> dict:
    """Run the schedule once: (round times while joining, newcomer's time to its first step, tokens)."""
    dev = eng.model.device
    sched = Scheduler(eng, round_tokens=round_tokens)
    runs = [eng.start(eng.request(p, **OPTS)) for p in prompts]
    for run in runs:
        sched.add(run)
    for _ in range(warm):
        sched.step()
    _sync(dev)
    first = {}
    late = eng.start(eng.request(newcomer, **OPTS), on_step=lambda i, x: first.setdefault("t", time.perf_counter()))
    t_add = time.perf_counter()
    sched.add(late)
    rounds = []
    while "t" not in first and sched.has_work:
        t0 = time.perf_counter()
        sched.step()
        _sync(dev)
        rounds.append(time.perf_counter() - t0)
    sched.run_all()
    return {"round_tokens": round_tokens, "rounds_while_joining": len(rounds),
            "round_max_s": max(rounds), "round_p50_s": statistics.median(rounds),
            "newcomer_first_step_s": first["t"] - t_add, "fill_slices": sched.stats.fill_slices,
            "tokens": [run.result().tokens for run in [*runs, late]]}


def run(args, rec):
    cpu = args.cpu or not torch.cuda.is_available()
    name = args.model or ("tiny-llada" if cpu else "llada-8b")
    model = load(name, device="cpu" if cpu else "cuda")
    eng = MosaicEngine(model, {"progress": False})
    B = args.decoders or (4 if cpu else 16)
    P = args.prompt or (64 if cpu else 1024)
    J = args.join_prompt or (2048 if cpu else 8192)
    budgets = args.round_tokens if args.round_tokens is not None else [2048, 1024]
    rec["config"] |= {"model": name, "decoders": B, "prompt": P, "join_prompt": J, "options": OPTS,
                      "round_tokens": budgets, "warm": args.warm}
    prompts = [_ids(model, P, s) for s in range(B)]
    newcomer = _ids(model, J, 999)
    one_setting(eng, prompts[:1], newcomer[:P], None, 1)        # kernels loaded, tuned, captured once
    rec["settings"] = []
    ref = None
    for rt in (None, *budgets):
        res = one_setting(eng, prompts, newcomer, rt, args.warm)
        toks = res.pop("tokens")
        ref = ref or toks
        res["tokens_equal_whole_fills"] = all(torch.equal(a, b) for a, b in zip(ref, toks))
        rec["settings"].append(res)
        rec.save()
        print(json.dumps(res), flush=True)
    return rec


def table(rec) -> str:
    lines = [f"{'round_tokens':>12} {'rounds':>6} {'round max s':>11} {'p50 s':>7} {'newcomer 1st step s':>19} "
             f"{'slices':>6} {'same tokens':>11}"]
    for r in rec.get("settings", []):
        lines.append(f"{str(r['round_tokens'] or 'whole'):>12} {r['rounds_while_joining']:>6} "
                     f"{r['round_max_s']:>11.3f} {r['round_p50_s']:>7.3f} {r['newcomer_first_step_s']:>19.3f} "
                     f"{r['fill_slices']:>6} {str(r['tokens_equal_whole_fills']):>11}")
    return "\n".join(lines)
