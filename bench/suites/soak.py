"""The memory budget holds by the device's own counter: random requests and L_max probes.

The budget under load, two parts, each one process and one 10-minute slot (run from the repository root):

    python -m bench soak --part soak   --out DIR     # ~4.5 min on one H200 -> DIR/soak.json
    python -m bench soak --part probes --out DIR     # ~4 min on one H200   -> DIR/probes.json
    python -m bench soak --cpu-smoke   --out /tmp/soak   # the suite's logic, tiny models
    python -m bench soak --part graphs --out DIR     # ~5 min: captured steps (bench/lib/soak_graphs.py)

soak: >= 500 random requests with an NVML sampler (2 ms) running: the three presets depth-
truncated to one layer and charged the full weights (mosaic.load(name, num_layers=1)), budgets
from 18 to 80 GiB, log-uniform N up to 1.02x the budget's physical limit but capped by a step-time
model (attention is quadratic: a 1-layer step at 2.9 M tokens takes minutes), random masked
counts, steps and sampler options, ~10% batches of two, and half of the requests at budgets
whose limit takes under 2.5 s drawn at 0.975-1.01x the physical limit (the admission edge).
Counted: admitted, refused, over budget
(NVML peak + the truncated layers' bytes > budget), out-of-memory errors, the largest overrun,
the prediction error (admission's predicted bytes vs the measured peak), and the driver's growth
outside PyTorch and the arena per request (what LATE_LOAD_BYTES must cover).
probes: LLaDA-8B at full depth at its 20 GiB L_max (the first soak's request, ~75 s) and a request
16k tokens longer refused with nothing taken; then every preset at its predicted L_max at 24 GiB
and LLaDA-8B at 40 GiB (1 layer, mask ratio 1.0, one step; --only picks some). L_max comes from `mosaic
plan`'s code path (capacity_report) with the engine's measured context and workspace, and the
plan's predicted peak is checked to equal run-time admission's.

Between configurations the soak closes the engine, drops it, collects garbage and empties
PyTorch's cache before the next one is built (the driver's counter is the process's: nothing of
an earlier engine may remain in it). Every other request starts after `guard.release` (pool,
arena pages, cached blocks handed back: `released` in its row), so that its measured peak is its
own and the prediction error is taken on those rows; the others start on whatever the previous
request left, as a user's requests do, and count for the over-budget check like all rows.

JSON (soak.json / probes.json, rewritten after every request) under --out, a table printed last,
also when the run is stopped by SIGTERM / SIGINT (timeout)."""

from __future__ import annotations

import math
import os
import random
import signal
import time
import traceback
from pathlib import Path

import torch

from bench.lib import engine as E
from bench.lib import soak_graphs
from bench.lib.measure import free, meter, meter_source
from mosaic import LengthWarning, MemoryBudgetError, MosaicEngine, load
from mosaic.memory.accounting import INPUT_BYTES_PER_TOKEN, Budget, floor_bytes_per_token
from mosaic.memory.device_meter import DeviceMeter
from mosaic.policy.capacity import capacity_report

GiB, MiB = 2**30, 2**20
PRESETS = ("llada-8b", "dream-7b", "llada-moe-7b")
LEVELS_GIB = (18, 19, 20, 22, 24, 28, 32, 40, 48, 64, 80)


def make_meter(cpu: bool):
    """The driver's counter (NVML, else cudaMemGetInfo) with its pre-context baseline, or a
    meter that reads 0 on the CPU smoke run. Call before anything creates the CUDA context."""
    if cpu:
        class Zero:
            def device_used(self):
                return 0

            def process_used(self, pid):
                return None

            def total(self):
                return 0
        return DeviceMeter(Zero(), mode="device"), {"driver": "none (cpu smoke)"}
    m = meter(mode="auto")
    info = {"driver": getattr(m.driver, "kind", type(m.driver).__name__)}
    if meter_source(m) == "nvml":
        info["baseline_bytes"] = m.set_baseline()     # no CUDA context yet
    info["mode"] = m.mode
    return m, info


def step_seconds(cfg, n: int, masked: int, batch: int = 1) -> float:
    """A one-layer step's time on an H200, roughly: attention at ~350 TFLOP/s, the layer's
    products and the mask-only logits at ~500, plus 30 ms of fixed cost."""
    q_dim = cfg.num_heads * cfg.head_dim
    attn = 4 * batch * n * n * q_dim / 350e12
    ffn = cfg.ffn * (cfg.top_k if cfg.num_experts else 1)
    dense = 2 * batch * n * (cfg.hidden * (q_dim + 2 * cfg.kv_dim) + q_dim * cfg.hidden + 3 * cfg.hidden * ffn)
    return attn + dense / 500e12 + 2 * masked * cfg.hidden * cfg.vocab / 500e12 + 0.03


def options(rng, family: str, gen_len: int) -> tuple[dict, int]:
    """Random sampler options for a family and the step count they run."""
    steps = rng.choice((1, 1, 1, 2))
    if family == "dream":
        o = {"alg": rng.choice(("origin", "maskgit_plus", "topk_margin", "entropy"))}
        if rng.random() < 0.3:
            o["temperature"] = 0.4
            if rng.random() < 0.5:
                o["top_p"] = 0.9
            if rng.random() < 0.3:
                o["top_k"] = 50
        elif o["alg"] == "origin":
            o["temperature"] = 0.3
        return o, steps
    o = {"remasking": rng.choice(("low_confidence", "low_confidence", "random"))}
    if rng.random() < 0.25:
        o["temperature"] = 0.5
    if rng.random() < 0.15:
        o["cfg_scale"] = 0.5
    if rng.random() < 0.2:
        o["confidence_dtype"] = "float64"
    if rng.random() < 0.1:
        o["logits_eos_inf"] = True
    blocks = 2 if steps == 2 and gen_len % 2 == 0 and rng.random() < 0.5 else 1
    o["block_length"] = gen_len // blocks
    return o, steps


def plan_requests(rng, models: dict, count: int, seconds: float, cpu: bool, levels) -> list[dict]:
    """Random requests whose modelled step time totals at most `seconds`."""
    out, total = [], 0.0
    names = list(models)
    per_request = seconds / count
    while len(out) < count:
        name = names[len(out) % len(names)]
        model = models[name]
        cfg = model.cfg
        budget = rng.choice(levels(model))
        bud = Budget.h200(budget, model.weight_bytes()) if not cpu else \
            Budget.build(budget, model.weight_bytes(), 0, 320 * MiB, cuda=False)
        physical = max(0, budget - bud.fixed_bytes - bud.rounding_bytes) // (floor_bytes_per_token(cfg)
                                                                            + INPUT_BYTES_PER_TOKEN)
        batch = 2 if rng.random() < 0.1 else 1
        top = max(256, int(1.02 * physical) // batch)
        cap = 4096 if cpu else 400_000
        edge = int(physical / batch)
        tight = top <= cap and rng.random() < 0.5 and \
            step_seconds(cfg, edge, edge // 2, batch) < (0.05 if cpu else 2.5)   # the admission edge
        if tight:
            n = int(physical / batch * rng.uniform(0.975, 1.01))
        else:
            n = int(math.exp(rng.uniform(math.log(256), math.log(min(top, cap)))))
        gen_len = max(2, int(n * rng.uniform(0.05, 0.95)) // 2 * 2)
        opts, steps = options(rng, cfg.family if cfg.family != "llada_moe" else "llada", gen_len)
        cost = steps * step_seconds(cfg, n, gen_len * batch, batch * (2 if opts.get("cfg_scale") else 1))
        if not cpu and cost > 6 * per_request + 4 * max(0.0, per_request * (len(out) + 1) - total):
            continue        # too slow for what is left of the time budget: draw again
        total += cost
        out.append({"model": name, "budget_bytes": budget, "tokens": n, "gen_len": gen_len, "batch": batch,
                    "steps": steps, "options": opts, "modelled_s": cost, "tight": tight})
    return sorted(out, key=lambda r: (names.index(r["model"]), r["budget_bytes"]))


def prompt_ids(rng, cfg, n: int) -> list[int]:
    span = min(cfg.vocab, cfg.mask_id) - 2
    return [1 + rng.randrange(span) for _ in range(n)]


TRACE = os.environ.get("MOSAIC_OOM_TRACE") == "1"   # record allocation stacks; name live blocks on OOM


AT_OOM: list = []   # the allocator's snapshot taken by the OOM observer, before the stack unwinds


def live_blocks(top: int = 25) -> list[dict]:
    """The largest live PyTorch blocks at an out-of-memory error, each with the Mosaic frames of
    the stack that allocated it (torch.cuda.memory._record_memory_history must be on): what
    allocated outside the plan. Read from the snapshot the OOM observer took at the failing
    allocation (c36a732's trace read the blocks after the exception had unwound: too late)."""
    out = []
    snap = AT_OOM.pop() if AT_OOM else torch.cuda.memory._snapshot()
    AT_OOM.clear()
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "active_allocated":
                continue
            frames = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in b.get("frames", [])
                      if "mosaic" in f["filename"] or "bench" in f["filename"]]
            if not any("loader.py" in f or "checkpoint" in f for f in frames):   # not the weights
                out.append({"bytes": b["size"], "frames": frames[:8]})
    return sorted(out, key=lambda r: -r["bytes"])[:top]


def run_request(engine, meter, req: dict, rng, missing: int, release: bool = False) -> dict:
    cfg = engine.model.cfg
    plen = req["tokens"] - req["gen_len"]
    prompts = [prompt_ids(rng, cfg, plen - 7 * b) for b in range(req["batch"])]  # padded batches
    dev = engine.model.device
    cuda = dev.type == "cuda"
    released = bool(release and E.release(engine))   # this request's peak is its own
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        reserved0 = torch.cuda.memory_reserved()
    arena0 = E.arena_extra_bytes(engine, now=True)
    E.reset_arena_peak(engine)
    row = dict(req, released=released)
    t0 = time.perf_counter()
    admitted = None
    with meter.window() as w:
        try:
            run = E.start(engine, prompts if req["batch"] > 1 else prompts[0], max_new_tokens=req["gen_len"],
                          steps=req["steps"], progress=False, **req["options"])
            admitted = run.admission
            out = run.run()
            row["status"] = "admitted"
            row["graphs"] = out.stats.get("graphs")    # captured steps: mode, captures, replays, failures
        except MemoryBudgetError as e:   # after admission: the guard found an accounting miss
            row["status"] = "refused" if admitted is None else "guard_error"
            row["message"] = str(e)[:300]
        except torch.cuda.OutOfMemoryError as e:
            row["status"], row["message"] = "oom", str(e)[:300]
            if TRACE:
                row["live_blocks"] = live_blocks()
        except Exception as e:  # noqa: BLE001  (recorded, the soak goes on)
            row["status"], row["message"] = "error", f"{type(e).__name__}: {e}"[:300]
        if cuda:
            torch.cuda.synchronize()
    row["seconds"] = time.perf_counter() - t0
    row["predicted_bytes"] = admitted.predicted_bytes if admitted is not None else None
    row["measured_bytes"] = w.peak_bytes + missing
    row["start_bytes"], row["end_bytes"] = w.start_bytes + missing, w.end_bytes + missing
    row["over_bytes"] = row["measured_bytes"] - req["budget_bytes"]
    if row["predicted_bytes"] and row["measured_bytes"] > 0:
        row["prediction_error"] = (row["predicted_bytes"] - row["measured_bytes"]) / row["measured_bytes"]
    if cuda:  # the engine's own view and the driver's growth outside PyTorch and the arena
        reserved1 = torch.cuda.memory_reserved()
        arena1 = E.arena_extra_bytes(engine, now=True)
        row["torch_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
        row["arena_peak_bytes"] = E.arena_extra_bytes(engine)
        row["driver_growth_bytes"] = (w.end_bytes - reserved1 - arena1) - (w.start_bytes - reserved0 - arena0)
        row["torch_limit_bytes"] = E.guard_limit_bytes(engine)   # set during it
        row["torch_reserved_start_bytes"], row["arena_start_bytes"] = int(reserved0), int(arena0)
    return row


def summarize(rows: list[dict]) -> dict:
    adm = [r for r in rows if r["status"] == "admitted"]
    # the prediction is of a request's own peak: rows that started on a released device
    own = [r for r in adm if r.get("released") or "released" not in r]
    errs = [r["prediction_error"] for r in own if r.get("prediction_error") is not None]
    return {"requests": len(rows), "admitted": len(adm),
            "refused": sum(r["status"] == "refused" for r in rows),
            "oom": sum(r["status"] == "oom" for r in rows),
            "errors": sum(r["status"] == "error" for r in rows),
            "guard_errors": sum(r["status"] == "guard_error" for r in rows),
            "over_budget": sum(r["over_bytes"] > 0 for r in rows),
            "started_over_budget": sum(r["start_bytes"] > r["budget_bytes"] for r in rows),
            "max_overrun_bytes": max((r["over_bytes"] for r in rows), default=None),
            "refused_taking_bytes": max((r["end_bytes"] - r["start_bytes"] for r in rows
                                         if r["status"] == "refused"), default=0),
            "prediction_rows": len(errs),
            "prediction_error_min": min(errs, default=None), "prediction_error_max": max(errs, default=None),
            "predicted_below_measured": sum(e < 0 for e in errs),
            "driver_growth_max_bytes": max((r.get("driver_growth_bytes", 0) for r in rows), default=0),
            "driver_growth_total_bytes": sum(max(0, r.get("driver_growth_bytes", 0)) for r in rows)}


def release_device(cpu: bool) -> None:
    """Everything dropped so far leaves the device before the next measurement."""
    free("cpu" if cpu else None)


def close(engine) -> None:
    engine.close()          # the arena's pages, the guard's pool and cap


def soak(args, rec, meter, info) -> dict:
    rng = random.Random(args.seed)
    cpu = args.cpu_smoke
    if cpu:
        names = ("tiny-llada", "tiny-dream")
        loaded = {n: load(n, device="cpu") for n in names}
        levels = lambda m: [m.weight_bytes() + 320 * MiB + k * MiB for k in (2, 8, 32, 128)]  # noqa: E731
    else:
        names = PRESETS
        loaded = {n: load(n, device="meta") for n in names}
        levels = lambda m: [g * GiB for g in LEVELS_GIB]  # noqa: E731
    reqs = plan_requests(rng, loaded, args.requests, args.seconds * 0.55, cpu, levels)
    res = rec
    res.update(meter=info, part="soak", rows=[])
    t0 = time.perf_counter()
    for idx, name in enumerate(names):
        t_end = t0 + (idx + 1) * args.seconds / len(names)   # each preset its share of the time
        model = load(name, device="cpu") if cpu else load(name, device="cuda", num_layers=1)
        missing = E.missing_weight_bytes(model)
        for budget in sorted({r["budget_bytes"] for r in reqs if r["model"] == name}):
            if time.perf_counter() > t_end:
                break
            try:
                engine = MosaicEngine(model, {"memory_budget": budget, "progress": False})
            except Exception as e:  # noqa: BLE001
                res.setdefault("engine_errors", []).append(f"{name} @ {budget}: {e}")
                continue
            res.setdefault("warmups", []).append({"model": name, "budget_bytes": budget,
                                                  "workspace_bytes": E.budget(engine).workspace_bytes,
                                                  "context_bytes": E.budget(engine).context_bytes,
                                                  **{k: v for k, v in E.warmup_report(engine).items()
                                                     if k != "skipped"}})
            for req in (r for r in reqs if r["model"] == name and r["budget_bytes"] == budget):
                if time.perf_counter() > t_end:
                    break
                res["rows"].append(run_request(engine, meter, req, rng, missing, release=len(res["rows"]) % 2 == 1))
                res["summary"] = summarize(res["rows"])
                res.save()
            close(engine)
            del engine
            release_device(cpu)
        del model
        release_device(cpu)
    res["summary"] = summarize(res["rows"])
    res["planned"] = len(reqs)
    res.save()
    return res


def probe(meter, name: str, budget: str, layers, refuse_after: bool = False, cpu: bool = False) -> dict:
    """One step at the predicted L_max (mask ratio 1.0), measured by the driver."""
    model = load(name, device="cpu" if cpu else "cuda", num_layers=layers)
    missing = E.missing_weight_bytes(model)
    engine = MosaicEngine(model, {"memory_budget": budget, "progress": False})
    b = E.budget(engine)
    rep = capacity_report(load(name, device="meta"), budget, context_bytes=b.context_bytes,
                          workspace_bytes=b.workspace_bytes, target="cpu" if cpu else "cuda")
    n = rep["l_max"]
    rng = random.Random(0)
    gen_len = n // 2
    opts = {"block_length": gen_len} if "block_length" in E.sampler_options(engine) else {}
    req = {"model": name, "budget_bytes": rep["budget_bytes"], "tokens": n, "gen_len": gen_len, "batch": 1,
           "steps": 1, "options": opts}
    row = run_request(engine, meter, req, rng, missing)
    row |= {"layers": layers or model.cfg.num_layers, "l_max": n, "plan_predicted_bytes":
            rep["steps"][0]["predicted_peak_bytes"] if rep["steps"] else None,
            "chunks": E.last_chunks(engine),
            "workspace_bytes": b.workspace_bytes, "context_bytes": b.context_bytes}
    row["plan_equals_admission"] = row["plan_predicted_bytes"] == row["predicted_bytes"]
    if refuse_after:
        more = dict(req, tokens=n + 16384, gen_len=(n + 16384) // 2, options=
                    {"block_length": (n + 16384) // 2} if opts else {})
        r2 = run_request(engine, meter, more, rng, missing)
        row["refusal"] = {k: r2[k] for k in ("tokens", "status", "start_bytes", "end_bytes", "seconds")} | \
            {"message": r2.get("message"), "taken_bytes": r2["end_bytes"] - r2["start_bytes"]}
    close(engine)
    del engine, model
    release_device(cpu)
    return row


def probes(args, rec, meter, info) -> dict:
    res = rec
    res.update(meter=info, part="probes", rows=[])
    if args.cpu_smoke:
        cases = [("tiny-llada", "420MiB", None, True)]
    else:
        # the full-depth probe first: it is the first soak's own request and must not be cut by the cap
        cases = [("llada-8b", "20GiB", None, True)] + [(m, "24GiB", 1, False) for m in
                                                       ("llada-8b", "llada-moe-7b", "dream-7b")] + \
            [("llada-8b", "40GiB", 1, False)]
    if args.only:
        cases = [c for c in cases if f"{c[0]}@{c[1]}{'@full' if c[2] is None else ''}" in args.only]
    t_end = time.perf_counter() + args.seconds
    for name, budget, layers, refuse in cases:
        if time.perf_counter() > t_end:
            res["rows"].append({"model": name, "budget": budget, "status": "skipped (time)"})
            continue
        try:
            res["rows"].append(probe(meter, name, budget, layers, refuse, args.cpu_smoke))
        except Exception as e:  # noqa: BLE001
            res["rows"].append({"model": name, "budget": budget, "status": "error",
                                "message": "".join(traceback.format_exception(e))[-1500:]})
        res.save()
    return res


def rows_table(res: dict) -> str:
    lines = []
    if res["part"] in ("soak", "graphs"):
        s = res["summary"]
        lines.append(" ".join(f"{k}={v}" for k, v in s.items()))
    lines.append(f"{'model':<13} {'budget':>7} {'layers':>6} {'N':>10} {'status':>9} {'predicted':>10} "
                 f"{'measured':>10} {'error':>8} {'over MiB':>9}")
    rows = res["rows"] if res["part"] == "probes" else \
        sorted(res["rows"], key=lambda r: -r["measured_bytes"] / r["budget_bytes"])[:12]
    for r in rows:
        if "measured_bytes" not in r:
            lines.append(f"{r['model']:<13} {r.get('budget', ''):>7} {r.get('status')}")
            continue
        pred = f"{r['predicted_bytes'] / GiB:.3f}" if r.get("predicted_bytes") else "-"
        err = f"{100 * r['prediction_error']:.2f}%" if r.get("prediction_error") is not None else "-"
        lines.append(f"{r['model']:<13} {r['budget_bytes'] / GiB:>7.2f} {r.get('layers', 1):>6} "
                     f"{r['tokens']:>10,} {r['status']:>9} {pred:>10} {r['measured_bytes'] / GiB:>10.3f} "
                     f"{err:>8} {r['over_bytes'] / MiB:>9.1f}")
    return "\n".join(lines)


def add_arguments(ap):
    ap.add_argument("--part", choices=("soak", "probes", "graphs"), default="soak")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--seconds", type=float, default=None, help="wall-clock cap of the part")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny models on the CPU, no driver counter")
    ap.add_argument("--only", nargs="+", help="probes to run, e.g. llada-8b@20GiB@full dream-7b@24GiB")


def output(args) -> str:
    return f"{args.part}.json"


def run(args, rec) -> dict:  # noqa: C901
    if TRACE and torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(max_entries=200_000)
        observe = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)   # CUDA builds
        if observe is not None:
            observe(lambda device, alloc, allocated, free: AT_OOM.append(torch.cuda.memory._snapshot()))
    if args.seconds is None:
        args.seconds = 30.0 if args.cpu_smoke else {"soak": 270.0, "probes": 280.0, "graphs": 300.0}[args.part]
    if args.part == "graphs" and args.requests == 500:
        args.requests = 120                      # bench/lib/soak_graphs.py: ~5 minutes
    if args.cpu_smoke:
        args.requests = min(args.requests, 40)
    import warnings
    warnings.simplefilter("ignore", LengthWarning)   # the soak runs past the trained length on purpose
    meter, info = make_meter(args.cpu_smoke)

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, stop)     # `timeout` ends the run: still print what ran
    meter.start()
    try:
        if args.part == "graphs":
            soak_graphs.graphs(args, rec, meter, info, run_request, summarize, release_device)
        else:
            soak(args, rec, meter, info) if args.part == "soak" else probes(args, rec, meter, info)
    except KeyboardInterrupt as e:
        rec.exit_code = 124
        print(f"stopped ({e}); the JSON under {args.out} holds every finished request", flush=True)
    finally:
        meter.stop()
    if rec.get("rows") and rec["part"] == "soak":
        rec["summary"] = summarize(rec["rows"])
    if rec.get("rows") and rec["part"] == "graphs":
        rec["summary"] = soak_graphs.summary(rec["rows"], summarize)
    return rec


def table(res: dict) -> str:
    if not res.get("rows"):
        return "no request finished"
    return rows_table(res)
