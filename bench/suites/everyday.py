"""Everyday requests on one GPU: steps vs floors and native, chat-turn tok/s, batches, captures.

Step costs beside their floors and the native path, end-to-end tok/s of a chat turn,
batched block steps, and the first request of a new length.

Every part runs in a fresh process (leftovers of an earlier part would inflate the next) and
writes one JSON; `--part all` (python -m bench everyday --out DIR) runs them in turn and writes
everyday.json with a table last.

  floors    matrix rate (8192^3 bf16 mm) and copy bandwidth, measured here
  exact     one exact step (all canvas positions candidates) at N = 512 .. 32k tokens: Mosaic
            with captured steps, Mosaic eager (cuda_graphs off), the native forward + sampler
  e2e       one timed generate() per row, prompt -> tokens: 1k and 8k prompts + 256 tokens, block
            32, exact / prefix / dual (threshold 0.9), graphs on and off; tokens compared
  batch     dual cache, 1k + 128, generate() of 1 / 4 / 16 / 64 prompts through the Scheduler:
            tok/s, ms per round beside the compute floor, the batched block step beside its floor,
            the driver's peak, rows that differ alone, batch-invariant mode at 1 and 16
            (bench/lib/batched.py)
  newlen    the first request of a new prompt length (capture) vs the same request warm
  dream, moe  exact step at 1k and dual-cache e2e at 1k for Dream-7B and LLaDA-MoE
  budget, sampled, sampled_dream, served   captured steps under a budget, with random draws
            and through the server, beside the unbudgeted greedy figure (bench/lib/everyday_graphs.py)

Random weights (presets): on them threshold decoding commits about one token per forward, so
tok/s here is tokens per forward-cost; a trained model commits several."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.lib import batched
from bench.lib import everyday_graphs as G
from bench.lib.measure import canvas, median
from bench.lib.record import record_header
from mosaic import MosaicEngine, load

PARTS = ("floors", "exact", "e2e1k", "e2e8k", "batch", "newlen", "dream", "moe", "illada", "profile", "profile_all",
         "profile_dream", "profile_illada", "budget", "sampled", "sampled_dream", "served")


def ms(fn, repeat=5, warmup=2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return median(out)


def floors() -> dict:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    t = ms(lambda: torch.mm(a, a), repeat=10, warmup=3)
    x = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    c = ms(lambda: y.copy_(x), repeat=10, warmup=3)
    return {"matrix_tflops": 2 * 8192**3 / (t * 1e-3) / 1e12,
            "copy_bytes_per_s": 2 * x.numel() / (c * 1e-3)}   # bytes read + written


def step_flops(cfg, n: int, m: int) -> float:
    """Linear layers 2 N params_per_layer, attention 4 N^2 hd H, masked logits 2 M d V."""
    d, f, L = cfg.hidden, cfg.ffn, cfg.num_layers
    per_layer = d * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * d + (3 * d * f * (cfg.top_k or 1))
    return L * (2 * n * per_layer + 4 * n * n * cfg.head_dim * cfg.num_heads) + 2 * m * d * cfg.vocab


def exact(name: str, lengths, fl: dict) -> dict:
    model = load(name, device="cuda")
    graphs = MosaicEngine(model, {"progress": False})
    eager = MosaicEngine(model, {"progress": False, "cuda_graphs": "off"})
    rows = []
    for n in lengths:
        m = min(256, n // 2)
        x = canvas(model, n, m)
        row = {"tokens": n, "masked": m}
        row["mosaic_graphs_ms"] = ms(lambda x=x: graphs.step(x))
        row["mosaic_eager_ms"] = ms(lambda x=x: eager.step(x))
        row["native_ms"] = ms(lambda x=x: eager.step(x, native=True))
        a = graphs.step(x)
        b = eager.step(x, native=True)
        row["tokens_equal_native"] = bool(torch.equal(a[0], b[0]))
        row["compute_floor_ms"] = step_flops(model.cfg, n, m) / (fl["matrix_tflops"] * 1e12) * 1e3
        row["ratio_native"] = row["mosaic_graphs_ms"] / row["native_ms"]
        row["ratio_floor"] = row["mosaic_graphs_ms"] / row["compute_floor_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"model": name, "steps": rows, "graphs": graphs.graphs.stats.as_dict()}


def e2e(name: str, prompts, fl: dict, graphs_off: bool = True, modes=("exact", "prefix", "dual"),
        warm: bool = True) -> dict:
    model = load(name, device="cuda")
    engines = {"graphs": MosaicEngine(model, {"progress": False})}
    if graphs_off:
        engines["eager"] = MosaicEngine(model, {"progress": False, "cuda_graphs": "off"})
    # reading every weight once at the copy rate (bytes read + written per second: a read-only
    # stream runs at about that rate too): 16.0 GB / 4.2 TB/s = 3.8 ms for LLaDA-8B in bf16
    weight_floor_ms = model.weight_bytes() / fl["copy_bytes_per_s"] * 1e3
    rows = []
    for P in prompts:
        ids = canvas(model, P, 0)[0].tolist()
        ids = [t for t in ids if t != model.cfg.mask_id]
        for mode in modes:
            opts = dict(max_new_tokens=256, block_length=32, steps=256)
            if mode != "exact":
                opts |= dict(cache=mode, threshold=0.9)
            outs = {}
            for label, eng in engines.items():
                if warm and mode != "exact":   # a block cache's captures (one per block) happen here
                    eng.generate(ids, **opts)
                out = eng.generate(ids, **opts)                 # the timed one: prompt -> tokens
                outs[label] = out
                nfe = out.stats.get("nfe", out.steps)
                row = {"prompt": P, "mode": mode, "engine": label, "warm": warm or mode == "exact",
                       "seconds": out.seconds,
                       "tok_per_s": 256 / out.seconds, "forwards": nfe, "ms_per_forward": 1e3 * out.seconds / nfe,
                       "weights_byte_floor_ms": weight_floor_ms}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if "eager" in outs:
                rows[-1]["tokens_equal_eager"] = bool(torch.equal(outs["graphs"].tokens, outs["eager"].tokens))
    return {"model": name, "e2e": rows, "graphs": engines["graphs"].graphs.stats.as_dict()}


def newlen(name: str) -> dict:
    model = load(name, device="cuda")
    eng = MosaicEngine(model, {"progress": False})
    warm_ids = [t for t in canvas(model, 1000, 0, seed=1)[0].tolist() if t != model.cfg.mask_id]
    opts = dict(max_new_tokens=256, block_length=32, steps=256, cache="dual", threshold=0.9)
    eng.generate(warm_ids, **opts)          # kernels loaded and tuned once for the process
    rows = []
    for P in (1100, 1300):
        ids = [t for t in canvas(model, P, 0, seed=P)[0].tolist() if t != model.cfg.mask_id]
        first = eng.generate(ids, **opts)
        second = eng.generate(ids, **opts)
        rows.append({"prompt": len(ids), "first_s": first.seconds, "warm_s": second.seconds,
                     "first_over_warm": first.seconds / second.seconds})
        print(json.dumps(rows[-1]), flush=True)
    return {"model": name, "newlen": rows, "graphs": eng.graphs.stats.as_dict()}


def profile(name: str, config: dict | None = None) -> dict:
    """Where a dual-cache forward's time goes: the host's functions (cProfile over one warm
    request), the GPU time of the captured block step (CUDA events around its replay) and its
    per-kernel breakdown (torch.profiler over replays of that graph: time and launches per kernel
    and per group), beside the same block step run eager (cuda_graphs off) under the profiler.
    config: engine options over the defaults (profile_all: fused_projections 'all')."""
    import cProfile
    import pstats

    from bench.lib.profiler import kernel_breakdown
    model = load(name, device="cuda")
    eng = MosaicEngine(model, {"progress": False, **(config or {})})
    ids = [t for t in canvas(model, 1024, 0)[0].tolist() if t != model.cfg.mask_id]
    opts = dict(max_new_tokens=256, block_length=32, steps=256, cache="dual", threshold=0.9)
    eng.generate(ids, **opts)
    prof = cProfile.Profile()
    prof.enable()
    out = eng.generate(ids, **opts)
    prof.disable()
    stats = pstats.Stats(prof)
    top = sorted(((v[3], f"{k[0].split('mosaic/')[-1]}:{k[1]}:{k[2]}", v[1]) for k, v in stats.stats.items()),
                 reverse=True)[:40]
    ahead = run_ahead_ab(eng, ids, opts)
    g = eng.graphs
    block = [c for k, c in g.graphs.items() if k[3] and k[3][0] == "block"][-1]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        block.graph.replay()
    end.record()
    torch.cuda.synchronize()
    replay = kernel_breakdown(block.graph.replay, repeat=10, top=40)
    eager_eng = MosaicEngine(model, {"progress": False, "cuda_graphs": "off", **(config or {})})
    eager = eager_kernels(eager_eng, ids, opts, kernel_breakdown)
    return {"model": name, "seconds": out.seconds, "forwards": out.stats["nfe"],
            "ms_per_forward": 1e3 * out.seconds / out.stats["nfe"],
            "block_replay_gpu_ms": start.elapsed_time(end) / 20, "block_replay_kernels": replay,
            "block_eager_kernels": eager, "weights_gb": model.weight_bytes() / 1e9,
            "host_top": [{"cum_s": t, "fn": f, "calls": n} for t, f, n in top], "graphs": g.stats.as_dict(),
            "run_ahead": ahead}


def run_ahead_ab(eng, ids, opts) -> dict:
    """One timed request (no cProfile) with the block steps launched one ahead of the host's
    readback (fast_llada.RUN_AHEAD, the default) and one without: ms per forward, same tokens."""
    from mosaic.runtime.samplers import fast_llada
    out = {}
    try:
        for on in (False, True):
            fast_llada.RUN_AHEAD = on
            out[on] = eng.generate(ids, **opts)
    finally:
        fast_llada.RUN_AHEAD = True
    ms = {on: 1e3 * o.seconds / o.stats["nfe"] for on, o in out.items()}
    return {"ms_per_forward_on": ms[True], "ms_per_forward_off": ms[False], "speedup": ms[False] / ms[True],
            "tokens_equal": bool(torch.equal(out[True].tokens, out[False].tokens)),
            "nfe_on": out[True].stats["nfe"], "nfe_off": out[False].stats["nfe"],
            "forwards_discarded": out[True].stats.get("forwards_discarded")}


def eager_kernels(eng, ids, opts, breakdown) -> dict:
    """The kernels of one eager dual block step (the 5th forward of a request: the block's
    second step) under the profiler."""
    from bench.lib.engine import wrap_planned_execute
    calls = {"n": 0}

    def wrap(real):
        def execute(step, prepared, *a, **k):
            calls["n"] += 1
            if calls["n"] != 5:
                return real(step, prepared, *a, **k)
            got = {}
            res = breakdown(lambda: got.update(outs=real(step, prepared, *a, **k)), repeat=1, top=40)
            calls["result"] = res | {"mode": step.cache.mode if step.cache is not None else "plain"}
            return got["outs"]
        return execute
    restore = wrap_planned_execute(eng, wrap)
    try:
        eng.generate(ids, **{**opts, "max_new_tokens": 32, "steps": 32})
    finally:
        restore()
    return calls.get("result", {})


def run_part(part: str, out: Path) -> dict:
    fl = None
    if part != "floors":     # the floors part's rates, measured here when it has not run in `out`
        path = out / "floors.json"
        fl = json.loads(path.read_text())["result"] if path.exists() else floors()
    res = {"floors": lambda: floors(),
           "exact": lambda: exact("llada-8b", (512, 1024, 2048, 8192, 32768), fl),
           "e2e1k": lambda: e2e("llada-8b", (1024,), fl),
           "e2e8k": lambda: e2e("llada-8b", (8192,), fl, graphs_off=False, warm=False),
           "batch": lambda: batched.batch("llada-8b", (1, 4, 16, 64), fl),
           "newlen": lambda: newlen("llada-8b"),
           "dream": lambda: {**exact("dream-7b", (1024,), fl), **e2e("dream-7b", (1024,), fl, False, ("dual",))},
           "moe": lambda: {**exact("llada-moe-7b", (1024,), fl),
                           **e2e("llada-moe-7b", (1024,), fl, False, ("dual",))},
           "illada": lambda: e2e("illada-8b", (1024,), fl, False, ("prefix", "dual")),
           "profile": lambda: profile("llada-8b"),
           "profile_all": lambda: profile("llada-8b", {"fused_projections": "all"}),
           "profile_dream": lambda: profile("dream-7b"),
           "profile_illada": lambda: profile("illada-8b"),
           "budget": lambda: G.budget(fl),
           "sampled": lambda: G.sampled("llada-8b", fl, [("dual", {}, dict(temperature=0.7, seed=1)),
                                                         ("exact", {}, dict(temperature=0.7, seed=1))]),
           "sampled_dream": lambda: G.sampled("dream-7b", fl, [("dual", {}, dict(temperature=0.2, top_p=0.95,
                                                                                   seed=1))]),
           "served": lambda: G.served(fl)}[part]()
    rec = record_header({"part": part}) | {"result": res}
    (out / f"{part}.json").write_text(json.dumps(rec, indent=1))
    return rec


def table_of(out: Path) -> str:  # noqa: C901
    lines = []
    for part in PARTS:
        p = out / f"{part}.json"
        if not p.exists():
            lines.append(f"{part}: not run")
            continue
        r = json.loads(p.read_text())["result"]
        if part == "floors":
            lines.append(f"floors: {r['matrix_tflops']:.0f} TFLOP/s, copy {r['copy_bytes_per_s'] / 1e12:.2f} TB/s")
        for s in r.get("steps", []):
            lines.append(f"{r['model']} step N={s['tokens']:>6}: graphs {s['mosaic_graphs_ms']:.1f} ms, eager "
                         f"{s['mosaic_eager_ms']:.1f}, native {s['native_ms']:.1f} ({s['ratio_native']:.2f}x native, "
                         f"{s['ratio_floor']:.2f}x floor {s['compute_floor_ms']:.1f}) "
                         f"same: {s['tokens_equal_native']}")
        for e in r.get("e2e", []):
            lines.append(f"{r['model']} e2e {e['prompt']}+256 {e['mode']:<6} {e['engine']:<6}: "
                         f"{e['tok_per_s']:.1f} tok/s, {e['ms_per_forward']:.1f} ms/forward "
                         f"(weights floor {e['weights_byte_floor_ms']:.1f})")
        lines += batched.table_lines(r)
        for n in r.get("newlen", []):
            lines.append(f"{r['model']} new length {n['prompt']}: first {n['first_s']:.2f} s, warm {n['warm_s']:.2f} s "
                         f"({n['first_over_warm']:.2f}x)")
        if "block_replay_gpu_ms" in r:
            lines.append(f"profile: {r['ms_per_forward']:.2f} ms/forward, block graph replay "
                         f"{r['block_replay_gpu_ms']:.2f} ms on the GPU; host (cumulative s):")
            lines += [f"    {h['cum_s']:7.3f} {h['calls']:>6} {h['fn']}" for h in r["host_top"][:25]]
            if r.get("run_ahead"):
                a = r["run_ahead"]
                lines.append(f"  run ahead: {a['ms_per_forward_on']:.2f} ms/forward vs {a['ms_per_forward_off']:.2f} "
                             f"without ({a['speedup']:.2f}x), same tokens {a['tokens_equal']}, nfe {a['nfe_on']}/"
                             f"{a['nfe_off']}, discarded {a['forwards_discarded']}")
            for label in ("block_replay_kernels", "block_eager_kernels"):
                k = r.get(label) or {}
                if not k:
                    continue
                lines.append(f"  {r['model']} {label}: {k['kernel_ms_total']:.2f} ms in {k['launches_total']:.0f} "
                             "launches; groups: " + ", ".join(
                                 f"{g} {ms:.2f} ms/{k['groups_launches'][g]:.0f}"
                                 for g, ms in sorted(k["groups_ms"].items(), key=lambda kv: -kv[1])))
                lines += [f"    {t['ms']:7.3f} ms {t['launches']:>5.0f}x {t['name'][:90]}"
                          for t in k["top_kernels"][:15]]
        lines += G.table_lines(r)
        if "graphs" in r:
            lines.append(f"  graphs ({part}): {r['graphs']}")
    return "\n".join(lines)


def add_arguments(ap):
    ap.add_argument("--part", default="all", choices=("all", *PARTS))
    ap.add_argument("--only", nargs="*", default=None, help="with --part all: these parts")
    ap.add_argument("--part-timeout", type=int, default=240)


def output(args) -> str:
    return "everyday.json" if args.part == "all" else f"everyday_{args.part}_run.json"


def run(args, rec):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part != "all":
        rec["result"] = run_part(args.part, out)["result"]
        return rec
    for part in args.only or PARTS:
        t0 = time.perf_counter()
        try:   # a fresh process per part: leftovers of one would inflate the next
            rc = subprocess.run([sys.executable, "-m", "bench", "everyday", "--part", part, "--out", str(out)],
                                timeout=args.part_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"== part {part}: rc {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
    rec["parts"] = {p: json.loads((out / f"{p}.json").read_text()) for p in PARTS if (out / f"{p}.json").exists()}
    rec["out"] = str(out)
    return rec


def table(rec) -> str:
    return table_of(Path(rec["out"])) if "out" in rec else json.dumps(rec.get("result", {}))[:2000]
