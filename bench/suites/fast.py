"""Fast-dLLM decoding on a GPU: cached step costs, NFE per token, end to end, the cache tier.

    python -m bench fast --out DIR    (about 3-4 minutes on one H200)

Per-step cost with and without the block cache, NFE per token on the bundled models, their
product as the end-to-end speed-up, and the GPU/CPU cache tier. Cases (each in try/except; JSON
to DIR/fast.json, a table printed last):
  steps     llada-8b preset (random weights, bf16): a full step of the reference sampler (32
            candidate rows), a fill step (full + K/V written to the store), a dual-cache block
            step (32 rows) and prefix-cache block steps (rows [block start, L), every block), at
            a 1k prompt + 256 new tokens and an 8k prompt + 256 (block 32)
  nfe       NFE per generated token of each setting on the bundled tiny-llada (held-out prompts)
  speedup   per setting: reference time 256 x full step vs fill/block steps at that NFE
            (8 fills, the rest block steps), and a measured end-to-end run at 1k (exact 256 steps
            vs dual cache with the count schedule at the same NFE): seconds and tokens/s
  tier      at --tier-tokens (default 65,536): fill and dual block step with every layer on the
            device, every layer on the host (two device slots), and the split a budget forces
            (kv_tier auto); transfer time alone; hidden share = 1 - (t_tier - t_device) / t_transfer
"""

from __future__ import annotations

import time

import torch

from bench.lib import engine as E
from bench.lib.measure import canvas as full_canvas
from bench.lib.measure import free, median, sync, timed
from mosaic import MosaicEngine, load
from mosaic.assets import tasks
from mosaic.config import GenerationConfig
from mosaic.memory.kv_store import KVStore, StoreLayout

GEN, BLOCK = 256, 32
SETTINGS = [("dual, threshold 0.9", dict(cache="dual", threshold=0.9)),
            ("prefix, threshold 0.9", dict(cache="prefix", threshold=0.9)),
            ("none, threshold 0.9", dict(threshold=0.9)),
            ("dual, factor 1.0", dict(cache="dual", factor=1.0))]


def canvas(model, prompt_len: int, seed: int = 0):
    """A seeded random prompt of prompt_len ids and GEN masked positions after it."""
    return full_canvas(model, prompt_len + GEN, GEN, seed=seed)


def predictor(engine, gen, store):
    g = torch.Generator(device=engine.model.device).manual_seed(0)
    return E.planned_predict(engine, gen, store, g)


def step_costs(engine, prompt_len: int, repeat: int) -> dict:
    """Milliseconds of a full step, a fill, dual block steps and prefix block steps."""
    model = engine.model
    x = canvas(model, prompt_len)
    L, mask_id = x.shape[1], model.cfg.mask_id
    gen = GenerationConfig(max_new_tokens=GEN, steps=GEN, block_length=BLOCK, cache="dual", threshold=0.9)
    store = KVStore(StoreLayout.of(model.cfg, 1, L, model.embed.element_size()), model.device, model.dtype)
    predict = predictor(engine, gen, store)
    lo, hi = prompt_len, prompt_len + BLOCK
    cand = (x == mask_id)
    cand[:, hi:] = False
    rec = {"prompt": prompt_len, "tokens": L, "store_bytes": store.layout.device_bytes}
    rec["full_ms"] = median(timed(lambda: predict(x, 0, L, cand, None), repeat))
    rec["fill_ms"] = median(timed(lambda: predict(x, 0, L, cand, "fill"), repeat))
    bc = cand[:, lo:hi].clone()
    rec["dual_block_ms"] = median(timed(lambda: predict(x, lo, hi, bc, "block"), repeat))
    prefix = []
    for nb in range(GEN // BLOCK):   # the prefix cache's block steps shrink block by block
        a = prompt_len + nb * BLOCK
        c = x[:, a:] == mask_id
        c[:, BLOCK:] = False
        predict(x, 0, L, cand, "fill")
        prefix.append(median(timed(lambda a=a, c=c: predict(x, a, L, c, "block"), repeat)))
    rec["prefix_block_ms"] = prefix
    rec["prefix_block_mean_ms"] = sum(prefix) / len(prefix)
    del store
    free()
    return rec


def nfe_per_token(per_shape: int) -> dict:
    """Per sequence (batch 1, as Fast-dLLM reports): forwards per generated token and accuracy."""
    engine = MosaicEngine("tiny-llada", {"progress": False})
    prompts = tasks.held_out(per_shape)
    out = {}
    for label, opts in [("exact", dict(steps=tasks.ANSWER_LEN))] + \
            [(lab, dict(o, steps=2, block_length=4)) for lab, o in SETTINGS]:
        right = nfe = 0
        for p in prompts:
            r = engine.generate(p, max_new_tokens=tasks.ANSWER_LEN, **opts)
            right += r.text == tasks.solve(p)
            nfe += r.steps
        out[label] = {"nfe_per_token": nfe / (len(prompts) * tasks.ANSWER_LEN), "accuracy": right / len(prompts),
                      "count": len(prompts)}
    return out


def modelled_speedup(costs: dict, nfe: dict) -> dict:
    """Reference: GEN full steps (one token each). Fast: 8 fills + the rest block steps."""
    ref_ms = GEN * costs["full_ms"]
    out = {}
    for label, opts in SETTINGS:
        if label not in nfe:
            continue
        steps = max(GEN // BLOCK, round(nfe[label]["nfe_per_token"] * GEN))
        fills = GEN // BLOCK
        cache = opts.get("cache", "none")
        block_ms = {"dual": costs["dual_block_ms"], "prefix": costs["prefix_block_mean_ms"],
                    "none": costs["full_ms"]}[cache]
        fill_ms = costs["fill_ms"] if cache != "none" else costs["full_ms"]
        fast_ms = fills * fill_ms + (steps - fills) * block_ms
        out[label] = {"nfe": steps, "fast_ms": fast_ms, "reference_ms": ref_ms, "speedup": ref_ms / fast_ms,
                      "step_speedup": ref_ms / GEN / (fast_ms / steps), "nfe_speedup": GEN / steps,
                      "tokens_per_s": GEN / (fast_ms / 1e3)}
    return out


def measured_e2e(engine, prompt_len: int, nfe: int) -> dict:
    """Wall time of whole generations at a prompt of prompt_len: the exact sampler (GEN steps) and
    the dual cache at the count schedule with `nfe` steps (random weights: counts, not confidence)."""
    p = canvas(engine.model, prompt_len)[0, :prompt_len].tolist()
    steps = max(GEN // BLOCK, (nfe // (GEN // BLOCK)) * (GEN // BLOCK))
    out = {}
    for label, opts in (("exact", dict(steps=GEN)), ("dual, counts", dict(steps=steps, cache="dual"))):
        warm = dict(opts, steps=GEN // BLOCK) if label == "exact" else opts   # records every template
        engine.generate(p, max_new_tokens=GEN, block_length=BLOCK, **warm)
        sync()
        t0 = time.perf_counter()
        r = engine.generate(p, max_new_tokens=GEN, block_length=BLOCK, **opts)
        sync()
        s = time.perf_counter() - t0
        out[label] = {"seconds": s, "steps": r.steps, "tokens_per_s": GEN / s}
    out["speedup"] = out["exact"]["seconds"] / out["dual, counts"]["seconds"]
    return out


def tier_case(engine, tokens: int, budget: str | None, repeat: int) -> dict:
    model = engine.model
    prompt_len = tokens - GEN
    x = canvas(model, prompt_len)
    L, mask_id, cfg = x.shape[1], model.cfg.mask_id, model.cfg
    gen = GenerationConfig(max_new_tokens=GEN, steps=GEN, block_length=BLOCK, cache="dual", threshold=0.9)
    lo, hi = prompt_len, prompt_len + BLOCK
    cand = x == mask_id
    cand[:, hi:] = False
    bc = cand[:, lo:hi].clone()
    rec = {"tokens": L}
    layouts = {"device": None, "host": 0}
    if budget is not None:   # the split a budget forces: admission picks the hot layers (kv_tier auto)
        try:
            forced = MosaicEngine(model, {"progress": False, "memory_budget": budget, "kv_tier": "auto"})
            adm = E.admit(forced, 1, L, gen)
            layouts["budget " + budget] = E.store_hot_layers(adm)
            rec["budget"] = {"budget": budget, "hot_layers": E.store_hot_layers(adm),
                             "predicted_bytes": adm.predicted_bytes, "chunks": list(adm.chunks)}
            del forced
        except Exception as e:  # noqa: BLE001
            rec["budget"] = {"budget": budget, "error": f"{type(e).__name__}: {e}"}
    for name, hot in layouts.items():
        store = KVStore(StoreLayout.of(cfg, 1, L, model.embed.element_size(), hot), model.device, model.dtype)
        predict = predictor(engine, gen, store)
        t0 = time.perf_counter()
        fill = timed(lambda: predict(x, 0, L, cand, "fill"), repeat)
        blk = timed(lambda: predict(x, lo, hi, bc, "block"), repeat)
        rec[name] = {"hot_layers": store.layout.hot, "device_bytes": store.layout.device_bytes,
                     "host_bytes": store.layout.host_bytes, "fill_ms": median(fill), "block_ms": median(blk),
                     "wall_s": time.perf_counter() - t0}
        cold = cfg.num_layers - store.layout.hot
        if cold:   # the transfers alone, one layer at a time on the side stream's path
            lay = store.layout
            h = store.host[0]
            d = store.slots[0]
            d2h = median(timed(lambda: h.copy_(d, non_blocking=True), repeat))
            h2d = median(timed(lambda: d[:, :, :lo].copy_(h[:, :, :lo], non_blocking=True) if lay.batch == 1
                               else d.copy_(h, non_blocking=True), repeat))
            rec[name] |= {"transfer_fill_ms": cold * d2h, "transfer_block_ms": cold * h2d,
                          "d2h_GBps": lay.layer_bytes / d2h / 1e6, "h2d_GBps": lay.layer_bytes / h2d / 1e6}
        store = predict = None   # the store's buffers go before the next layout
        free()
    dev = rec["device"]
    for name in layouts:
        r = rec[name]
        if "transfer_fill_ms" in r:
            r["hidden_fill"] = 1 - max(0.0, r["fill_ms"] - dev["fill_ms"]) / r["transfer_fill_ms"]
            r["hidden_block"] = 1 - max(0.0, r["block_ms"] - dev["block_ms"]) / r["transfer_block_ms"]
    return rec


def add_arguments(ap):
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--per-shape", type=int, default=10)
    ap.add_argument("--tier-tokens", type=int, default=65536)
    ap.add_argument("--tier-budget", default="36GiB",
                    help="a budget that forces part of the store to the host (64k: 32 GiB of K/V, 15 GiB weights)")


def run(args, rec) -> dict:
    rec["cases"] = {}

    def case(name, fn):
        rec.case(name, fn, into="cases")
        free()

    case("nfe", lambda: nfe_per_token(args.per_shape))
    model = load("llada-8b", device="cuda")
    engine = MosaicEngine(model, {"progress": False})
    for prompt in (1024, 8192):
        case(f"steps_{prompt}", lambda p=prompt: step_costs(engine, p, args.repeat))
    nfe = rec["cases"].get("nfe", {})
    for prompt in (1024, 8192):
        costs = rec["cases"].get(f"steps_{prompt}", {})
        if "full_ms" in costs and "error" not in nfe:
            rec["cases"][f"speedup_{prompt}"] = modelled_speedup(costs, nfe)
    best = nfe.get("dual, threshold 0.9", {}).get("nfe_per_token", 0.25) if "error" not in nfe else 0.25
    case("e2e_1024", lambda: measured_e2e(engine, 1024, round(best * GEN)))
    case("e2e_8192", lambda: measured_e2e(engine, 8192, round(best * GEN)))   # README: measured, not modelled
    case(f"tier_{args.tier_tokens}", lambda: tier_case(engine, args.tier_tokens, args.tier_budget, 2))
    return rec


def table(rec) -> str:  # noqa: C901
    out = []
    c = rec["cases"]
    out.append("\nNFE per token on tiny-llada (held-out, 8 answer tokens in blocks of 4)")
    for label, r in c.get("nfe", {}).items():
        if isinstance(r, dict) and "nfe_per_token" in r:
            out.append(f"  {label:<24} NFE/token {r['nfe_per_token']:.3f}  accuracy {r['accuracy']:.1%}")
    for prompt in (1024, 8192):
        s = c.get(f"steps_{prompt}", {})
        if "full_ms" in s:
            out.append(f"\nllada-8b, {prompt} + {GEN} tokens: full step {s['full_ms']:.1f} ms, "
                  f"fill {s['fill_ms']:.1f} ms, dual block {s['dual_block_ms']:.1f} ms, "
                  f"prefix block mean {s['prefix_block_mean_ms']:.1f} ms")
        elif s:
            out.append(f"\nllada-8b, {prompt}: {s.get('error')}")
        for label, r in c.get(f"speedup_{prompt}", {}).items():
            out.append(f"  {label:<24} NFE {r['nfe']:>4}  step x{r['step_speedup']:.1f}  "
                  f"NFE x{r['nfe_speedup']:.1f}  end to end x{r['speedup']:.1f}  {r['tokens_per_s']:.0f} tokens/s")
    e = c.get("e2e_1024", {})
    if "speedup" in e:
        ex, du = e["exact"], e["dual, counts"]
        out.append(f"\nmeasured at 1024 + {GEN}: exact {ex['seconds']:.2f} s ({ex['tokens_per_s']:.0f} tok/s), "
              f"dual counts {du['seconds']:.2f} s ({du['tokens_per_s']:.0f} tok/s, {du['steps']} steps): "
              f"x{e['speedup']:.1f}")
    for k, t in c.items():
        if k.startswith("tier_") and isinstance(t, dict) and "device" in t:
            out.append(f"\ncache tier at {t['tokens']:,} tokens")
            for name, r in t.items():
                if isinstance(r, dict) and "fill_ms" in r:
                    extra = ""
                    if "hidden_fill" in r:
                        extra = (f"  transfer fill {r['transfer_fill_ms']:.0f} ms "
                                 f"(hidden {r['hidden_fill']:.0%}), block {r['transfer_block_ms']:.0f} ms "
                                 f"(hidden {r['hidden_block']:.0%})")
                    out.append(f"  {name:<16} hot {r['hot_layers']:>2}  fill {r['fill_ms']:.0f} ms  "
                          f"block {r['block_ms']:.1f} ms{extra}")
        elif k.startswith("tier_") and isinstance(t, dict) and "error" in t:
            out.append(f"\ncache tier: {t['error']}")
    return "\n".join(out).strip()
