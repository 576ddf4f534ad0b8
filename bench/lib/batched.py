"""The batch part of `python -m bench everyday`: generate() of B prompts of 1k tokens
+ 128 new ones, dual cache + threshold 0.9, block 32, at B = 1, 4, 16, 64 on one GPU, random
weights (about one token per forward). A list of prompts is a batch of requests
(engine/scheduler.py): each runs its own Fast-dLLM loop, their block steps (and their fills of
one length) stacked into one step per round over the paged K/V pool, padded to the batch bucket.
Per batch size, in one process:

  tok_per_s           end to end: B x 128 / the timed generate() (prompt -> tokens), after a
                      warm call with the same shapes (captures happen there)
  rounds              the batch's rounds (its longest request's forwards, Generation.stats nfe);
                      ms_per_round = seconds / rounds
  compute_floor_s     every forward's FLOPs (each request: 4 fills of 1,152 tokens + the rest
                      block steps of 32 rows against 1,152 keys) at the matrix rate measured by
                      the floors part; ratio_floor = seconds / it
  block_step_ms       the batched block step alone: its captured graph replayed 20 times (CUDA
                      events); step_tok_per_s = B x 1000 / block_step_ms, the block steps' rate
                      at one token per forward (what the batching targets name; end to end also
                      pays each request's 4 fills); floor_ms the larger of its compute floor
                      (linear layers 2 x rows x params, attention 4 x rows x keys x hd x H, masked
                      logits 2 x M x d x V, rows = M = B x 32, keys = 1k + 128) and one read of
                      every weight at the measured copy rate (what bounds small batches)
  peak_bytes          the driver's counter (NVML) over the timed call, against the device total
                      (no budget: captured steps run only without one)
  rows_differ_alone   default mode, B = 4 and 16: requests whose tokens differ from the same
                      prompt alone (bf16 GEMMs over other row counts)
  invariant           batch_invariant=True at B = 1 and 16: tok/s, x the default's, identical rows
"""

from __future__ import annotations

import json

import torch

from bench.lib.measure import canvas, meter
from mosaic import MosaicEngine, load
from mosaic.runtime.graph_buckets import batch_bucket

OPTS = dict(max_new_tokens=128, block_length=32, steps=128, cache="dual", threshold=0.9)
PROMPT = 1024


def linear_flops(cfg, n: int) -> float:
    """Every layer's projections and FFN over n rows (2 FLOPs a multiply-add)."""
    d, f = cfg.hidden, cfg.ffn
    per_layer = d * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * d + 3 * d * f * (cfg.top_k or 1)
    return cfg.num_layers * 2 * n * per_layer


def forward_flops(cfg, rows: int, keys: int, masked: int) -> float:
    """One forward of `rows` query rows against `keys` keys with `masked` logits rows."""
    attn = cfg.num_layers * 4 * rows * keys * cfg.head_dim * cfg.num_heads
    return linear_flops(cfg, rows) + attn + 2 * masked * cfg.hidden * cfg.vocab


def replay_ms(graphs, shape, kind: str) -> float | None:
    """GPU ms of the most replayed captured block step of this shape and kind ('block': one
    request's store, 'pool': stacked over the pool), 20 replays between CUDA events."""
    found = [c for k, c in graphs.graphs.items() if k[1] == shape and k[3] and k[3][0] == kind]
    if not found:
        return None
    g = max(found, key=lambda c: c.replays).graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    start.record()
    for _ in range(20):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


def block_step(eng, model, B: int, fl: dict) -> dict:
    """The batched block step's replayed time beside its floor (module docstring)."""
    rows, keys = B * OPTS["block_length"], PROMPT + OPTS["max_new_tokens"]
    compute = forward_flops(model.cfg, rows, keys, rows) / (fl["matrix_tflops"] * 1e12) * 1e3
    weights = model.weight_bytes() / fl["copy_bytes_per_s"] * 1e3
    floor = max(compute, weights)
    shape = ((batch_bucket(B) or B) if B > 1 else 1, OPTS["block_length"])
    step = replay_ms(eng.graphs, shape, "pool" if B > 1 else "block")
    return {"block_step_ms": step, "floor_ms": floor, "compute_floor_ms": compute, "weight_floor_ms": weights,
            "step_over_floor": step / floor if step else None, "step_tok_per_s": B * 1e3 / step if step else None}


def request_flops(cfg, nfe: int) -> float:
    """A dual-cache request of OPTS: one fill per block, the rest block steps."""
    length, bl = PROMPT + OPTS["max_new_tokens"], OPTS["block_length"]
    fills = OPTS["max_new_tokens"] // bl
    return fills * forward_flops(cfg, length, length, bl) + max(0, nfe - fills) * forward_flops(cfg, bl, length, bl)


def prompts_for(model, B: int) -> list[list[int]]:
    return [[t for t in canvas(model, PROMPT, 0, seed=s)[0].tolist() if t != model.cfg.mask_id][:PROMPT]
            for s in range(B)]


def timed(eng, prompts, opts=OPTS):
    """(Generation of a warm generate(), the driver's peak over it)."""
    eng.generate(prompts, **opts)            # captures, autotuning, arena growth
    torch.cuda.synchronize()
    m = meter()
    with m:
        out = eng.generate(prompts, **opts)
    return out, m.peak_bytes


def batch(name: str, sizes, fl: dict) -> dict:
    model = load(name, device="cuda")
    eng = MosaicEngine(model, {"progress": False})
    total = torch.cuda.get_device_properties(0).total_memory
    rate = fl["matrix_tflops"] * 1e12
    alone: dict[int, torch.Tensor] = {}
    rows, base = [], None
    for B in sizes:
        prompts = prompts_for(model, B)
        out, peak = timed(eng, prompts)
        tps = B * OPTS["max_new_tokens"] / out.seconds
        base = base or tps
        per_row = out.stats.get("nfe_per_row") or [out.stats["nfe"]]
        floor_s = sum(request_flops(model.cfg, n) for n in per_row) / rate
        row = {"batch": B, "seconds": out.seconds, "tok_per_s": tps, "speedup_vs_batch1": tps / base,
               "rounds": out.stats["nfe"], "forwards_per_request": sum(per_row) / len(per_row),
               "ms_per_round": 1e3 * out.seconds / out.stats["nfe"], "compute_floor_s": floor_s,
               "ratio_floor": out.seconds / floor_s, "peak_bytes": peak, "device_total_bytes": total,
               **block_step(eng, model, B, fl), "lossy": out.lossy}
        if B in (4, 16):
            for i, p in enumerate(prompts):
                if i not in alone:
                    alone[i] = eng.generate(p, **OPTS).tokens[0]
            row["rows_differ_alone"] = sum(int(not torch.equal(alone[i], out.tokens[i])) for i in range(B))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"model": name, "batch": rows, "invariant": invariant(model, rows), "graphs": eng.graphs.stats.as_dict()}


def invariant(model, default_rows: list[dict]) -> list[dict]:
    """batch_invariant=True at B = 1 and 16: throughput beside the default's, rows identical alone."""
    inv = MosaicEngine(model, {"progress": False, "batch_invariant": True})
    by_b = {r["batch"]: r for r in default_rows}
    out_rows = []
    for B in (1, 16):
        prompts = prompts_for(model, B)
        out, peak = timed(inv, prompts)
        tps = B * OPTS["max_new_tokens"] / out.seconds
        same = sum(int(torch.equal(inv.generate(p, **OPTS).tokens[0], out.tokens[i]))
                   for i, p in enumerate(prompts)) if B > 1 else 1
        row = {"batch": B, "tok_per_s": tps, "x_default": tps / by_b[B]["tok_per_s"] if B in by_b else None,
               "rows_identical_alone": same, "rows": B, "peak_bytes": peak}
        out_rows.append(row)
        print(json.dumps({"invariant": row}), flush=True)
    return out_rows


def table_lines(r: dict) -> list[str]:
    lines = []
    for b in r.get("batch", []):
        differ = f", {b['rows_differ_alone']}/{b['batch']} rows differ alone" if "rows_differ_alone" in b else ""
        lines.append(f"{r['model']} dual batch {b['batch']:>2}: {b['tok_per_s']:.1f} tok/s "
                     f"({b['speedup_vs_batch1']:.2f}x batch 1), {b['ms_per_round']:.1f} ms/round, "
                     f"{b['ratio_floor']:.2f}x the compute floor, peak {b['peak_bytes'] / 2**30:.1f} GiB{differ}")
        step = f"{b['block_step_ms']:.2f} ms ({b['step_over_floor']:.2f}x floor {b['floor_ms']:.2f}; " \
            f"{b['step_tok_per_s']:.0f} tok/s at one token per forward)" \
            if b.get("block_step_ms") else f"not captured (floor {b['floor_ms']:.2f} ms)"
        lines.append(f"    block step {step}")
    for v in r.get("invariant", []):
        x = f" ({v['x_default']:.2f}x default)" if v.get("x_default") else ""
        lines.append(f"  batch-invariant batch {v['batch']:>2}: {v['tok_per_s']:.1f} tok/s{x}, "
                     f"{v['rows_identical_alone']}/{v['rows']} rows identical alone")
    return lines
