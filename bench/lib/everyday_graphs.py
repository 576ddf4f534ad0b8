"""Parts of `python -m bench everyday` (bench/suites/everyday.py) for captured steps where users
meet them: under a memory budget, with random draws, and through the server. Each row is one timed generate()
(or one streamed HTTP request) after one warm-up of the same shape (the captures), beside the
unbudgeted greedy captured figure and the weights' floor measured in the same run.

  budget   llada-8b 1k + 256, block 32: dual cache + threshold 0.9 and the exact sampler, no
           budget vs memory_budget 60GiB (tokens compared; NVML peak of the budgeted request)
  sampled  llada-8b dual 0.9 and exact: greedy vs temperature 0.7 seed 1 (a second seeded run
           must repeat it; one eager run, cuda_graphs off, must give its tokens)
  sampled_dream  dream-7b dual 0.9: greedy vs temperature 0.2 top_p 0.95 seed 1 (the same checks)
  served   llada-8b behind `mosaic serve`'s app in this process (its budget: the free memory at
           start, as `mosaic serve` sets it), one client over loopback, streaming, dual 0.9,
           1k + 128: wall time to the last streamed token vs the same engine's generate()"""

from __future__ import annotations

import json
import time

import torch

from bench.lib.measure import canvas
from mosaic import MosaicEngine, load

DUAL = dict(cache="dual", threshold=0.9)


def _prompt(model, n: int, seed: int = 0) -> list[int]:
    return [t for t in canvas(model, n, 0, seed=seed)[0].tolist() if t != model.cfg.mask_id]


def _timed(eng, ids, opts, label: str, floor_ms: float, meter=None) -> tuple[dict, object]:
    """One warm-up (the captures) and one timed generate(); the row and its Generation."""
    eng.generate(ids, **opts)
    if meter is not None:
        with meter.window() as w:
            out = eng.generate(ids, **opts)
    else:
        w, out = None, eng.generate(ids, **opts)
    nfe = out.stats.get("nfe", out.steps)
    n = opts["max_new_tokens"]
    row = {"engine": label, "seconds": out.seconds, "tok_per_s": n / out.seconds, "forwards": nfe,
           "ms_per_forward": 1e3 * out.seconds / nfe, "weights_byte_floor_ms": floor_ms,
           "graphs": out.stats.get("graphs"), "lossy": out.lossy}
    if w is not None:
        row |= {"nvml_peak_bytes": w.peak_bytes, "budget_bytes": eng.budget.budget_bytes,
                "within_budget": w.peak_bytes <= eng.budget.budget_bytes}
    print(json.dumps(row), flush=True)
    return row, out


def budget(fl: dict) -> dict:
    from bench.lib.measure import meter
    model = load("llada-8b", device="cuda")
    floor_ms = model.weight_bytes() / fl["copy_bytes_per_s"] * 1e3
    free = MosaicEngine(model, {"progress": False})
    held = MosaicEngine(model, {"progress": False, "memory_budget": "60GiB"})
    ids = _prompt(model, 1024)
    rows = []
    with meter(mode="auto") as m:
        for mode in ("dual", "exact"):
            opts = dict(max_new_tokens=256, block_length=32, steps=256, **(DUAL if mode == "dual" else {}))
            a, out_a = _timed(free, ids, opts, "graphs", floor_ms)
            b, out_b = _timed(held, ids, opts, "graphs+budget 60GiB", floor_ms, m)
            b["ratio_unbudgeted"] = b["tok_per_s"] / a["tok_per_s"]
            b["tokens_equal_unbudgeted"] = bool(torch.equal(out_a.tokens, out_b.tokens))
            rows += [{"mode": mode, **a}, {"mode": mode, **b}]
    return {"model": "llada-8b", "budget_rows": rows, "graphs": held.graphs.stats.as_dict()}


def sampled(name: str, fl: dict, cases) -> dict:
    """cases: (mode, greedy options, sampled options); every run 1k + 256 (dual) or 1k + 256
    (exact), block 32."""
    model = load(name, device="cuda")
    floor_ms = model.weight_bytes() / fl["copy_bytes_per_s"] * 1e3
    eng = MosaicEngine(model, {"progress": False})
    eager = MosaicEngine(model, {"progress": False, "cuda_graphs": "off"})
    ids = _prompt(model, 1024)
    rows = []
    for mode, greedy, drawn in cases:
        base = dict(max_new_tokens=256, block_length=32, steps=256, **(DUAL if mode == "dual" else {}))
        g, _ = _timed(eng, ids, base | greedy, "greedy", floor_ms)
        s, out = _timed(eng, ids, base | drawn, f"sampled {drawn}", floor_ms)
        again = eng.generate(ids, **(base | drawn))
        t0 = time.perf_counter()
        ref = eager.generate(ids, **(base | drawn))
        s |= {"ratio_greedy": s["tok_per_s"] / g["tok_per_s"], "seeded_repeat_equal": bool(torch.equal(
              out.tokens, again.tokens)), "tokens_equal_eager": bool(torch.equal(out.tokens, ref.tokens)),
              "eager_tok_per_s": base["max_new_tokens"] / (time.perf_counter() - t0)}
        rows += [{"mode": mode, **g}, {"mode": mode, **s}]
        print(json.dumps(rows[-1]), flush=True)
    return {"model": name, "sampled_rows": rows, "graphs": eng.graphs.stats.as_dict()}


def served(fl: dict) -> dict:
    import asyncio

    import httpx

    from mosaic.config import EngineConfig
    from mosaic.serve.commands import default_budget
    from mosaic.serve.server import ServerThread
    econf, where = default_budget(EngineConfig.coerce({"progress": False, "device": "cuda"}))
    eng = MosaicEngine("llada-8b", econf)
    model = eng.model
    floor_ms = model.weight_bytes() / fl["copy_bytes_per_s"] * 1e3
    ids = _prompt(model, 1024)
    opts = dict(max_new_tokens=128, block_length=32, steps=128, **DUAL)
    direct, out = _timed(eng, ids, opts, "generate() (the server's engine, its budget)", floor_ms)
    with MosaicEngine(model, {"progress": False}) as other:     # closed here, not by the collector later
        free, _ = _timed(other, ids, opts, "generate(), no budget", floor_ms)
    body = {"prompt": ids, "max_tokens": 128, "stream": True, "ignore_eos": True, "block_length": 32,
            "steps": 128, **DUAL}

    async def one(url):
        t0, first, extra = time.perf_counter(), None, {}
        async with httpx.AsyncClient(timeout=600) as client, \
                client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200, (await r.aread())[:300]
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                    first = time.perf_counter() - t0
                extra = chunk.get("mosaic") or extra
        return time.perf_counter() - t0, first, extra
    with ServerThread(eng, max_batch=1, request_timeout=None) as srv:
        asyncio.run(one(srv.url))                       # warm: this thread's captures
        wall, ttft, extra = asyncio.run(one(srv.url))
    row = {"engine": "mosaic serve, one client, streaming", "seconds": wall, "tok_per_s": 128 / wall,
           "ttft_s": ttft, "engine_seconds": extra.get("engine_seconds"), "budget": where,
           "budget_bytes": eng.budget.budget_bytes, "ratio_generate": (128 / wall) / direct["tok_per_s"],
           "ratio_unbudgeted": (128 / wall) / free["tok_per_s"], "graphs": extra.get("stats", {}).get("graphs")}
    print(json.dumps(row), flush=True)
    return {"model": "llada-8b", "served_rows": [direct, free, row], "graphs": eng.graphs.stats.as_dict()}


def table_lines(r: dict) -> list[str]:
    lines = []
    for e in r.get("budget_rows", []):
        extra = "" if "ratio_unbudgeted" not in e else \
            f", {e['ratio_unbudgeted']:.2f}x unbudgeted, same tokens: {e['tokens_equal_unbudgeted']}, NVML " \
            f"{e['nvml_peak_bytes'] / 2**30:.2f} GiB of {e['budget_bytes'] / 2**30:.0f}"
        lines.append(f"{r['model']} 1k+256 {e['mode']:<5} {e['engine']:<20}: {e['tok_per_s']:.1f} tok/s, "
                     f"{e['ms_per_forward']:.1f} ms/forward (floor {e['weights_byte_floor_ms']:.1f}){extra}")
    for e in r.get("sampled_rows", []):
        extra = f", {e['ratio_greedy']:.2f}x greedy, repeat {e['seeded_repeat_equal']}, = eager " \
                f"{e['tokens_equal_eager']} (eager {e['eager_tok_per_s']:.1f})" if "ratio_greedy" in e else ""
        lines.append(f"{r['model']} 1k+256 {e['mode']:<5} {e['engine']:<40}: {e['tok_per_s']:.1f} tok/s, "
                     f"{e['ms_per_forward']:.1f} ms/forward{extra}")
    for e in r.get("served_rows", []):
        extra = f", {e['ratio_generate']:.2f}x generate(), {e['ratio_unbudgeted']:.2f}x unbudgeted" \
            if "ratio_generate" in e else ""
        lines.append(f"{r['model']} 1k+128 dual {e['engine']:<45}: {e['tok_per_s']:.1f} tok/s{extra}")
    return lines
