"""Each family's block step beside its byte floor at batch 1 and 32, and end-to-end tok/s (one H200).

    python -m bench families --out DIR          (every part in a fresh process; ~5-8 min on one H200)
    python -m bench families --only llada2-mini moe_kernels --out DIR
    # CPU smoke of the code (one layer, short prompts; not a figure):
    python -m bench families --device cpu --num-layers 1 --prompt 64 --gen 64 --gen-batch 64 --batches 1 2 \\
        --only llada-moe-7b llada2-mini --out DIR

Presets with random weights, bf16, no budget (steps captured as CUDA graphs). Parts, each in its
own process writing OUT/families_<part>.json, the table last:

  floors        the device copy bandwidth: a 2 GiB copy, bytes read + written per second
  llada-8b, illada-8b, dream-7b, llada-moe-7b
                Fast-dLLM's dual cache (block 32, threshold 0.9); llada2-mini: its published
                sampler (block 32, 32 steps per block, threshold 0.95). Per batch B (1 and 32):
                B prompts of --prompt tokens + --gen new tokens (--gen-batch when B > 1): one
                warm generate() (kernels, captures), one timed: tok/s = B x gen / seconds,
                forwards, ms per forward. The block step: the GPU time of its captured graph's
                replay (CUDA events, mean of 20; the last one-block graph of the run) beside its
                byte floor (bench/lib/floors.step_read_bytes): every layer weight, the LM head, of
                a MoE layer only the experts its rows reach (routing measured on an eager copy
                of the run: models/moe_grouped.route_observers, the calls with B x 32 rows) and
                the K/V its queries attend (dual: the whole canvas; LLaDA2: up to the block's
                end), at the measured copy bandwidth. With random weights a threshold rarely
                fires: about one token per forward
  moe_kernels   one MoE layer's experts (LLaDA2-mini and LLaDA-MoE geometry) at 32 / 256 / 1024 /
                2048 rows: the per-expert loop, torch._grouped_mm, the Triton kernel, eager and
                captured, beside the floor of the experts reached (bench/lib/moe_bench.py)
  moe_exact     LLaDA-MoE's exact step (every canvas position a candidate) at 1k / 4k / 8k:
                captured vs the native path (the published forward, one expert at a time), and
                whether they give the same tokens
  profile       where a block step's device time goes (llada2-mini, llada-moe-7b, batch 1): one
                block of an eager request under torch.profiler, kernels per forward and the top
                kernels by device time (in a captured step the launch gaps go, the kernels stay)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.lib import engine as E
from bench.lib.floors import step_read_bytes
from bench.lib.measure import canvas, free, median, sync
from bench.lib.record import record_header
from mosaic import MosaicEngine, load
from mosaic.models import moe_grouped

BLOCK = 32
FAMILIES = ("llada-8b", "illada-8b", "dream-7b", "llada-moe-7b", "llada2-mini")
PARTS = ("floors", *FAMILIES, "moe_kernels", "moe_exact", "profile")


def floors(device) -> dict:
    if device != "cuda":
        return {"copy_bytes_per_s": None}
    x = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    sync()
    t = []
    for _ in range(10):
        t0 = time.perf_counter()
        y.copy_(x)
        sync()
        t.append(time.perf_counter() - t0)
    return {"copy_bytes_per_s": 2 * x.numel() / median(t)}


def options(model, gen: int) -> dict:
    if model.cfg.family == "llada2":
        return dict(max_new_tokens=gen, block_length=BLOCK, steps=BLOCK)
    return dict(max_new_tokens=gen, block_length=BLOCK, steps=gen, cache="dual", threshold=0.9)


def prompts(model, P: int, B: int) -> list[list[int]]:
    return [[t for t in canvas(model, P, 0, seed=s)[0].tolist()] for s in range(B)]


def experts_reached(model, ps, opts, B: int) -> float | None:
    """Mean distinct experts per MoE layer over the block steps (B x 32 routed rows) of an eager
    run of two blocks (route observers see eager steps only)."""
    if not model.cfg.num_experts:
        return None
    seen = []
    obs = lambda t: seen.append(int(torch.unique(t).numel())) if t.shape[0] == B * BLOCK else None  # noqa: E731
    moe_grouped.route_observers.append(obs)
    try:
        MosaicEngine(model, {"progress": False, "cuda_graphs": "off"}).generate(
            ps, **{**opts, "max_new_tokens": 2 * BLOCK, "steps": min(opts["steps"], 2 * BLOCK)})
    finally:
        moe_grouped.route_observers.remove(obs)
    return sum(seen) / len(seen) if seen else None


def block_replay(engine, B: int):
    """(ms, where) of the GPU time of the engine's last captured one-block step of batch B, replayed
    right after the request (its store's memory is still PyTorch's: no cache trimmed since)."""
    for key, got in reversed(E.captured_steps(engine)):
        where = key[3]
        if key[1] == (B, BLOCK) and where and where[0] in ("block", "blocks", "pool"):   # pool: stacked requests
            for _ in range(3):
                got.graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                got.graph.replay()
            end.record()
            sync()
            return start.elapsed_time(end) / 20, list(where[:3])
    return None, None


def family(name: str, args, copy_bps) -> dict:
    model = load(name, device=args.device, dtype="bfloat16", num_layers=args.num_layers)
    rows = []
    for B in args.batches:
        gen = args.gen if B == 1 else args.gen_batch
        opts, ps = options(model, gen), prompts(model, args.prompt, B)
        engine = MosaicEngine(model, {"progress": False})
        engine.generate(ps, **opts)                    # warm: kernels, autotuning, captures
        sync()
        out = engine.generate(ps, **opts)              # timed: prompt -> tokens
        sync()
        nfe = out.stats.get("nfe", out.steps)
        row = {"batch": B, "prompt": args.prompt, "gen": gen, "options": opts, "seconds": out.seconds,
               "tok_per_s": B * gen / out.seconds, "forwards": nfe, "ms_per_forward": 1e3 * out.seconds / nfe,
               "graphs": E.graph_stats(engine)}
        step_ms, where = block_replay(engine, B) if args.device == "cuda" else (None, None)
        del engine
        reached = experts_reached(model, ps, opts, B)
        keys = where[2] if where and where[0] == "blocks" else args.prompt + gen   # LLaDA2: up to the block end
        floor = step_read_bytes(model, B, keys, reached)
        row |= {"block_step_ms": step_ms, "block_step_where": where, "experts_reached_per_layer": reached,
                "floor_bytes": floor}
        if copy_bps and step_ms:
            row["floor_ms"] = floor["total"] / copy_bps * 1e3
            row["weights_floor_ms"] = (floor["weights"] + floor["experts"]) / copy_bps * 1e3
            row["x_floor"] = step_ms / row["floor_ms"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "graphs"}), flush=True)
        free(model.device)
    return {"model": name, "rows": rows}


def moe_exact(args) -> dict:
    model = load("llada-moe-7b", device=args.device, dtype="bfloat16", num_layers=args.num_layers)
    graphs = MosaicEngine(model, {"progress": False})
    eager = MosaicEngine(model, {"progress": False, "cuda_graphs": "off"})
    rows = []
    for n in args.exact_lengths:
        x = canvas(model, n, min(256, n // 2))
        graphs.step(x)
        graphs.step(x)                                 # eager, then captured
        row = {"tokens": n, "graphs_ms": median([_timed(lambda: graphs.step(x)) for _ in range(5)]),
               "native_ms": median([_timed(lambda: eager.step(x, native=True)) for _ in range(3)])}
        row["x_native"] = row["graphs_ms"] / row["native_ms"]
        row["tokens_equal_native"] = bool(torch.equal(graphs.step(x)[0], eager.step(x, native=True)[0]))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"model": "llada-moe-7b", "rows": rows, "graphs": E.graph_stats(graphs)}


def profile_blocks(args) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    out = {}
    for name in ("llada2-mini", "llada-moe-7b"):
        model = load(name, device=args.device, dtype="bfloat16", num_layers=args.num_layers)
        engine = MosaicEngine(model, {"progress": False, "cuda_graphs": "off"})
        ps, opts = prompts(model, args.prompt, 1), options(model, BLOCK)
        engine.generate(ps, **opts)
        sync()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            got = engine.generate(ps, **opts)
            sync()
        kernels: dict[str, list] = {}
        for ev in prof.events():
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if t and ev.device_type.name == "CUDA":
                k = kernels.setdefault(ev.name[:160], [0, 0.0])
                k[0] += 1
                k[1] += t / 1e3
        nfe = got.stats.get("nfe", got.steps)
        top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]
        out[name] = {"forwards": nfe, "kernels_per_forward": sum(c for c, _ in kernels.values()) / nfe,
                     "device_ms_per_forward": sum(t for _, t in kernels.values()) / nfe,
                     "top": [{"name": k, "calls_per_forward": c / nfe, "ms_per_forward": t / nfe} for k, (c, t) in top]}
        print(json.dumps({k: v for k, v in out[name].items() if k != "top"}), flush=True)
        del engine, model
        free(args.device)
    return out


def _timed(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t0) * 1e3


def run_part(part: str, args, out: Path) -> dict:
    copy = None
    if part != "floors":
        copy = json.loads((out / "families_floors.json").read_text())["result"]["copy_bytes_per_s"] \
            if (out / "families_floors.json").exists() else None
    if part == "floors":
        res = floors(args.device)
    elif part in FAMILIES:
        res = family(part, args, copy)
    elif part == "moe_kernels":
        from bench.lib.moe_bench import GEOMETRY, layer
        res = {"rows": [layer(name, n, copy) for name in GEOMETRY for n in (32, 256, 1024, 2048)]}
    elif part == "profile":
        res = profile_blocks(args)
    else:
        res = moe_exact(args)
    rec = record_header({"part": part, **{k: v for k, v in vars(args).items() if k != "out"}}) | {"result": res}
    (out / f"families_{part}.json").write_text(json.dumps(rec, indent=1, default=str))
    return rec


def add_arguments(ap):
    ap.add_argument("--part", default="all", choices=("all", *PARTS), help="one part in this process")
    ap.add_argument("--only", nargs="*", default=None, help="with --part all: these parts (floors always first)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run of the code")
    ap.add_argument("--num-layers", type=int, default=None, help="keep the first layers only (smoke runs)")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--gen", type=int, default=256, help="new tokens at batch 1")
    ap.add_argument("--gen-batch", type=int, default=64, help="new tokens per request at batch > 1")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 32], help="batch sizes")
    ap.add_argument("--exact-lengths", type=int, nargs="*", default=[1024, 4096, 8192], help="moe_exact's N")
    ap.add_argument("--part-timeout", type=int, default=240, help="seconds per part")


def output(args) -> str:
    return "families.json" if args.part == "all" else f"families_{args.part}_run.json"


def run(args, rec):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part != "all":
        rec["result"] = run_part(args.part, args, out)["result"]
        return rec
    parts = ["floors", *[p for p in (args.only or PARTS) if p != "floors"]]
    if args.device == "cpu":
        parts = [p for p in parts if p not in ("moe_kernels", "profile")]
    flags = [f"--{k.replace('_', '-')}" for k in ("device", "num_layers", "prompt", "gen", "gen_batch")]
    passed = []
    for flag, key in zip(flags, ("device", "num_layers", "prompt", "gen", "gen_batch")):
        if getattr(args, key) is not None:
            passed += [flag, str(getattr(args, key))]
    passed += ["--batches", *map(str, args.batches), "--exact-lengths", *map(str, args.exact_lengths)]
    rec["parts_run"] = {}
    for part in parts:
        t0 = time.perf_counter()
        try:   # a fresh process per part: one model's memory must not inflate the next's
            rc = subprocess.run([sys.executable, "-m", "bench", "families", "--part", part, "--out", str(out),
                                 *passed], timeout=args.part_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        rec["parts_run"][part] = {"rc": rc, "seconds": time.perf_counter() - t0}
        print(f"== part {part}: rc {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
        rec.save()
    rec["parts"] = {p: json.loads((out / f"families_{p}.json").read_text())["result"] for p in parts
                    if (out / f"families_{p}.json").exists()}
    return rec


def table(rec) -> str:
    parts = rec.get("parts") or {rec["config"].get("part"): rec.get("result", {})}
    lines = [f"{'model':>13} {'B':>3} {'tok/s':>8} {'ms/fwd':>7} {'step ms':>8} {'floor ms':>9} {'x floor':>8} "
             f"{'experts/layer':>14}"]
    for name in FAMILIES:
        for r in (parts.get(name) or {}).get("rows", []):
            f = lambda v, w, p=2: f"{v:>{w}.{p}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"  # noqa: E731
            lines.append(f"{name:>13} {r['batch']:>3} {f(r['tok_per_s'], 8, 1)} {f(r['ms_per_forward'], 7)} "
                         f"{f(r.get('block_step_ms'), 8)} {f(r.get('floor_ms'), 9)} {f(r.get('x_floor'), 8)} "
                         f"{f(r.get('experts_reached_per_layer'), 14, 1)}")
    for r in (parts.get("moe_kernels") or {}).get("rows", []):
        lines.append(f"moe {r['model']} rows {r['rows']}: floor {r['floor_ms']:.3f} ms; " + ", ".join(
            f"{k} {r[k + '_graph_ms' if k != 'loop' else k + '_ms']:.3f}" for k in ("loop", "grouped", "triton")
            if (k + "_ms") in r))
    for name, r in (parts.get("profile") or {}).items():
        lines.append(f"profile {name}: {r['kernels_per_forward']:.0f} kernels, {r['device_ms_per_forward']:.2f} "
                     "device ms per forward (eager); top: " + ", ".join(
                         f"{t['name'][:40]} {t['ms_per_forward']:.2f}" for t in r["top"][:5]))
    for r in (parts.get("moe_exact") or {}).get("rows", []):
        lines.append(f"llada-moe exact N={r['tokens']}: {r['graphs_ms']:.1f} ms vs native {r['native_ms']:.1f} "
                     f"({r['x_native']:.2f}x), same tokens: {r['tokens_equal_native']}")
    return "\n".join(lines)
