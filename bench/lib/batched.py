"""The batch part of `python -m bench everyday` (issue 36): B prompts of 1k tokens + 128 new ones,
dual cache + threshold 0.9, block 32, at B = 1, 4, 16, 64 on one GPU, random weights (about one
token per forward). Per B and path, in one process:

  tok/s         end to end: one timed call from prompts to tokens (B x 128 / seconds), after a
                warm call with the same shapes (captures happen there)
  block_step_ms the batched block step alone: its captured graph replayed 20 times (CUDA events);
                step_tok_per_s = B x 1000 / block_step_ms, the block steps' rate at one token per
                forward (what issue 36's targets name; the end-to-end figure also pays each
                request's 4 fills: one full forward of its canvas per block of the dual cache)
  floor_ms      the larger of its compute floor at the measured matrix rate (floors part: linear
                layers 2 x rows x params, attention 4 x rows x keys x hd x H, masked logits
                2 x M x d x V, rows = B x 32, keys = 1k + 128, M = rows: a block's first step) and
                reading every weight once at the measured copy rate (what bounds small batches)
  tokens_equal  the two paths' tokens compared (the same kernels: equal unless GEMMs of other row
                counts round differently)

Paths:
  call    eng.generate(prompts): one call (before the Scheduler: one request of B left-padded
          rows with one store; with it: B requests)
  batch   B requests in the engine's continuous batch: their block steps stacked into one step
          over the paged pool, padded to the batch bucket, one attention call per layer
"""

from __future__ import annotations

import json
import time

import torch

from bench.lib.measure import canvas
from mosaic import MosaicEngine, load
from mosaic.runtime.graph_buckets import batch_bucket

OPTS = dict(max_new_tokens=128, block_length=32, steps=128, cache="dual", threshold=0.9)
PROMPT = 1024


def block_step_flops(cfg, rows: int, keys: int, masked: int) -> float:
    """Multiply-add FLOPs of one block step of `rows` query rows over `keys` keys per sequence."""
    d, f = cfg.hidden, cfg.ffn
    per_layer = d * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * d + 3 * d * f * (cfg.top_k or 1)
    attn = 4 * rows * keys * cfg.head_dim * cfg.num_heads
    return cfg.num_layers * (2 * rows * per_layer + attn) + 2 * masked * d * cfg.vocab


def _replay_ms(graphs, shape, kind: str) -> float | None:
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


def _call(eng, prompts):
    eng.generate(prompts, **OPTS)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = eng.generate(prompts, **OPTS)
    return [row for row in out.tokens], time.perf_counter() - t0, {"nfe": out.stats.get("nfe"), "lossy": out.lossy}


def _batch(eng, prompts):
    from mosaic.engine.batching import Batch

    def once():
        b = Batch(eng, max_rows=len(prompts))
        for p in prompts:
            b.add(eng.start(eng.request(p, **OPTS)))
        return b.run_all(), b
    once()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs, b = once()
    return ([o.tokens[0] for o in outs], time.perf_counter() - t0,
            {**b.stats.as_dict(), "lossy": outs[0].lossy, "fallbacks": b.stats.fallbacks[:3]})


def batch_part(name: str, sizes, fl: dict) -> dict:
    model = load(name, device="cuda")
    rows, base = [], {}
    for B in sizes:
        prompts = [[t for t in canvas(model, PROMPT, 0, seed=s)[0].tolist() if t != model.cfg.mask_id][:PROMPT]
                   for s in range(B)]
        compute = block_step_flops(model.cfg, B * 32, PROMPT + 128, B * 32) / (fl["matrix_tflops"] * 1e12) * 1e3
        weights = model.weight_bytes() / fl["copy_bytes_per_s"] * 1e3
        floor = max(compute, weights)
        tokens = {}
        for path, run, kind, shape in (("call", _call, "block", (B, 32)),
                                       ("batch", _batch, "pool", (batch_bucket(B) or B, 32))):
            eng = MosaicEngine(model, {"progress": False})
            try:
                toks, seconds, extra = run(eng, prompts)
            except Exception as e:  # noqa: BLE001  (a path that fails is reported, the other still runs)
                rows.append({"batch": B, "path": path, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            tps = B * OPTS["max_new_tokens"] / seconds
            base.setdefault(path, tps)
            step = _replay_ms(eng.graphs, shape, kind if B > 1 else "block")
            row = {"batch": B, "path": path, "seconds": seconds, "tok_per_s": tps,
                   "speedup_vs_batch1": tps / base[path], "block_step_ms": step, "floor_ms": floor,
                   "compute_floor_ms": compute, "weight_floor_ms": weights,
                   "step_over_floor": step / floor if step else None,
                   "step_tok_per_s": B * 1e3 / step if step else None,
                   "graphs": eng.graphs.stats.as_dict(), **extra}
            tokens[path] = toks
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "graphs"}), flush=True)
            eng.close()
            del eng
            torch.cuda.empty_cache()
        if len(tokens) == 2:
            rows[-1]["tokens_equal_call"] = sum(torch.equal(a.cpu(), b.cpu()) for a, b in zip(*tokens.values()))
    return {"model": name, "batch": rows}


def lines(r: dict) -> list[str]:
    out = []
    for b in r.get("batch", []):
        if "error" in b:
            out.append(f"{r['model']} dual batch {b['batch']:>2} {b['path']:<5}: {b['error']}")
            continue
        step = f"{b['block_step_ms']:.2f} ms ({b['step_over_floor']:.2f}x floor {b['floor_ms']:.2f}; " \
            f"{b['step_tok_per_s']:.0f} tok/s at one token per forward)" \
            if b.get("block_step_ms") else f"not captured (floor {b['floor_ms']:.2f} ms)"
        out.append(f"{r['model']} dual batch {b['batch']:>2} {b['path']:<5}: {b['tok_per_s']:.1f} tok/s "
                   f"({b['speedup_vs_batch1']:.2f}x batch 1), block step {step}")
    return out
