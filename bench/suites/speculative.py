"""Self-speculative decoding (exact) and the batch-invariant mode: forwards, acceptance, speed.

    python -m bench speculative --out DIR                    # CPU: the bundled models (~1.5 min)
    python -m bench speculative --device cuda --out DIR      # GPU: adds the llada-8b parts (H200: ~15 min)

Parts (each recorded on its own; JSON to OUT/speculative_<device>.json, a table printed last):
  tiny        tiny-llada and tiny-dream at their default settings (generation_config.json: 8
              tokens, 8 steps), one held-out prompt at a time (mosaic/assets/tasks.py) and one
              batch of all of them, for speculate K in --ks: whether the tokens equal the
              step-by-step run's (they must), forwards (NFE), canvas forwards, tokens per forward
              and the distribution of steps accepted per verification, seconds against the
              step-by-step run's (an idle CPU's wall clock says little: tiny matrices); on CUDA in
              batch-invariant mode (the mode in which GPU tokens are guaranteed identical)
  e2e         (CUDA) llada-8b preset (random weights), a --prompt-len prompt + 256 tokens, block
              32, one token per step: seconds, NFE, tokens per forward, ms per forward and per
              token, step-by-step vs speculate K, with batch_invariant off and on. Random weights
              make the acceptance meaningless as a quality figure; what this part measures is
              the cost of a verification forward of K canvases against a one-canvas step
  verify      (CUDA) one step of K = 1, 2, 4, 8 canvases of prompt-len + 256 tokens (256 masked):
              how close a K-canvas forward stays to one forward while the step is weight-bound
  gemm        (CUDA) the batch-invariant Triton GEMM against torch.mm (cuBLAS), bf16, at
              llada-8b's shapes: first at a block step's rows (--gemm-m, default 32 and 512:
              batch 1 and 16) for q/k/v/o, gate+up, down and the head (bench/lib/invariant_gemm.py:
              us, GB/s, the ratio, the tile, bits identical alone and in 2048 rows; --gemm-sweep
              times every tile), then for M = --tokens rows (4096 -> 4096 / 12288, 12288 -> 4096):
              TFLOP/s and the ratio (target >= 0.8)
  step        (CUDA) one llada-8b step at 1k-32k tokens (half masked), batch_invariant off vs on:
              ms and the ratio (target >= 0.8)
"""

from __future__ import annotations

import time
from collections import Counter

import torch

from bench.lib import engine as E
from bench.lib import invariant_gemm as IG
from bench.lib.measure import canvas, free, median, timed
from bench.lib.record import SuiteError
from mosaic import MosaicEngine, load
from mosaic.assets import tasks


def add_arguments(ap):
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--ks", type=int, nargs="*", default=[2, 4, 8], help="draft lengths (speculate K)")
    ap.add_argument("--per-shape", type=int, default=5, help="held-out prompts per task shape (8 shapes)")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--tokens", type=int, nargs="*", default=[1024, 4096, 8192, 16384, 32768])
    ap.add_argument("--only", nargs="*", default=None, help="parts to run (tiny e2e verify gemm step)")
    ap.add_argument("--gemm-m", type=int, nargs="*", default=[32, 512], help="gemm: a block step's rows")
    ap.add_argument("--gemm-sweep", action="store_true", help="gemm: time every tile of the invariant table")


def output(args) -> str:
    return f"speculative_{args.device}.json"


def tiny(name: str, ks, per_shape: int, device: str) -> dict:
    """The bundled model at its defaults: per prompt and for the whole batch, speculate K vs 0."""
    cfg = {"device": device, "progress": False, "batch_invariant": device == "cuda"}
    eng = MosaicEngine(name, cfg)
    prompts = tasks.held_out(per_shape)
    out = {"model": name, "prompts": len(prompts), "config": cfg, "ks": {}}
    t0 = time.perf_counter()
    ref = [eng.generate(p) for p in prompts]
    out["step_by_step_seconds"] = time.perf_counter() - t0
    ref_batch = eng.generate(prompts)
    out["steps"] = ref[0].steps
    for k in ks:
        acc, nfe, canv, tok, same, secs = Counter(), 0, 0, 0, 0, 0.0
        for p, r in zip(prompts, ref):
            t0 = time.perf_counter()
            g = eng.generate(p, speculate=k)
            secs += time.perf_counter() - t0
            same += bool(torch.equal(g.tokens, r.tokens))
            st = g.stats
            acc.update(st["accepted"])
            nfe, canv, tok = nfe + st["nfe"], canv + st["canvases"], tok + st["tokens"]
        b = eng.generate(prompts, speculate=k)
        out["ks"][k] = {"identical_prompts": same, "nfe": nfe, "canvases": canv, "tokens": tok,
                        "tokens_per_forward": tok / nfe, "step_by_step_nfe": sum(r.steps for r in ref),
                        "accepted": dict(sorted(acc.items())), "seconds": secs,
                        "batch": {"identical": bool(torch.equal(b.tokens, ref_batch.tokens)),
                                  **{key: b.stats[key] for key in ("nfe", "canvases", "tokens_per_forward",
                                                                    "accepted")}}}
        print(f"  {name} K={k}: identical {same}/{len(prompts)}, tokens/forward {tok / nfe:.2f}, "
              f"accepted {dict(sorted(acc.items()))}, batch identical {out['ks'][k]['batch']['identical']}",
              flush=True)
    eng.close()
    return out


def e2e(ks, prompt_len: int) -> dict:
    model = load("llada-8b", device="cuda")
    prompt = canvas(model, prompt_len, 0)[0].tolist()
    gen = dict(max_new_tokens=256, block_length=32, steps=256)
    out = []
    for inv in (False, True):
        eng = MosaicEngine(model, {"progress": False, "batch_invariant": inv})
        eng.generate(prompt, **{**gen, "max_new_tokens": 32, "steps": 32, "block_length": 32})   # warm-up
        base = None
        for k in [0, *ks]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            g = eng.generate(prompt, speculate=k, **gen)
            torch.cuda.synchronize()
            s = time.perf_counter() - t0
            nfe = g.stats.get("nfe", g.steps)
            row = {"batch_invariant": inv, "speculate": k, "seconds": s, "nfe": nfe,
                   "canvases": g.stats.get("canvases", g.steps), "tokens_per_forward": 256 / nfe,
                   "ms_per_forward": s * 1e3 / nfe, "ms_per_token": s * 1e3 / 256,
                   "accepted": g.stats.get("accepted"), "lossy": g.lossy}
            if base is None:
                base = g.tokens
            row["identical_to_step_by_step"] = bool(torch.equal(g.tokens, base))
            out.append(row)
            print(f"  e2e inv={inv} K={k}: {s:.1f} s, nfe {nfe}, {row['ms_per_forward']:.1f} ms/forward, "
                  f"{row['ms_per_token']:.1f} ms/token, identical {row['identical_to_step_by_step']}", flush=True)
        eng.close()
        free()
    return {"prompt_len": prompt_len, **gen, "runs": out}


def verify(prompt_len: int) -> list[dict]:
    model = load("llada-8b", device="cuda")
    out = []
    for inv in (False, True):
        eng = MosaicEngine(model, {"progress": False, "batch_invariant": inv})
        for k in (1, 2, 4, 8):
            x = canvas(model, prompt_len + 256, 256, batch=k)
            ms = median(timed(E.step_fn(eng, x), repeat=3))
            out.append({"batch_invariant": inv, "canvases": k, "ms": ms})
            print(f"  verify inv={inv} canvases={k}: {ms:.1f} ms", flush=True)
        eng.close()
        free()
    return out


def gemm(tokens) -> list[dict]:
    from mosaic.kernels import invariant_triton as T
    out = []
    for m in tokens:
        for k, n in ((4096, 4096), (4096, 12288), (12288, 4096)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            o = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = median(timed(lambda x=x, w=w, o=o: torch.mm(x, w.t(), out=o), repeat=10, warmup=3))
            inv = median(timed(lambda x=x, w=w, o=o: T.matmul(o, x, w), repeat=10, warmup=3))
            flops = 2 * m * k * n
            row = {"m": m, "k": k, "n": n, "cublas_tflops": flops / ref / 1e9, "invariant_tflops": flops / inv / 1e9}
            row["ratio"] = row["invariant_tflops"] / row["cublas_tflops"]
            out.append(row)
            print(f"  gemm {m}x{k}x{n}: cuBLAS {row['cublas_tflops']:.0f}, invariant {row['invariant_tflops']:.0f} "
                  f"TFLOP/s ({row['ratio']:.2f})", flush=True)
            del x, w, o
        free()
    return out


def step(tokens) -> list[dict]:
    model = load("llada-8b", device="cuda")
    engines = {inv: MosaicEngine(model, {"progress": False, "batch_invariant": inv}) for inv in (False, True)}
    out = []
    for n in tokens:
        x = canvas(model, n, n // 2)
        row = {"tokens": n, "masked": n // 2}
        for inv, eng in engines.items():
            try:
                row["invariant_ms" if inv else "default_ms"] = median(timed(E.step_fn(eng, x), repeat=3))
            except Exception as e:  # noqa: BLE001
                row["invariant_error" if inv else "default_error"] = repr(e)[:300]
            free()
        if "invariant_ms" in row and "default_ms" in row:
            row["speed_ratio"] = row["default_ms"] / row["invariant_ms"]
        out.append(row)
        print(f"  step N={n}: default {row.get('default_ms', 0):.0f} ms, invariant {row.get('invariant_ms', 0):.0f} "
              f"ms ({row.get('speed_ratio', 0):.2f} of the default's speed)", flush=True)
    return out


def run(args, rec) -> dict:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SuiteError("--device cuda needs a CUDA device")
    parts = args.only or (["tiny"] if args.device == "cpu" else ["tiny", "gemm", "step", "verify", "e2e"])
    if "tiny" in parts:
        for name in ("tiny-llada", "tiny-dream"):
            rec.case(name, lambda name=name: tiny(name, args.ks, args.per_shape, args.device), into="tiny")
    if args.device == "cuda":
        if "gemm" in parts:
            rec.case("gemm_rows", lambda: IG.table(args.gemm_m, args.gemm_sweep))
            rec.case("gemm", lambda: gemm(args.tokens))
        if "step" in parts:
            rec.case("step", lambda: step(args.tokens))
        if "verify" in parts:
            rec.case("verify", lambda: verify(args.prompt_len))
        if "e2e" in parts:
            rec.case("e2e", lambda: e2e(args.ks, args.prompt_len))
    return rec


def table(rec) -> str:
    lines = [f"{'model':<11} {'K':>2} {'identical':>10} {'NFE':>5} {'step NFE':>8} {'tok/fwd':>7} "
             f"{'batch tok/fwd':>13} {'s':>6} {'step s':>6}  accepted steps per verification"]
    for name, r in (rec.get("tiny") or {}).items():
        for k, v in (r.get("ks") or {}).items():
            lines.append(f"{name:<11} {k:>2} {v['identical_prompts']:>4}/{r['prompts']:<5} {v['nfe']:>5} "
                         f"{v['step_by_step_nfe']:>8} {v['tokens_per_forward']:>7.2f} "
                         f"{v['batch']['tokens_per_forward']:>13.2f} {v['seconds']:>6.1f} "
                         f"{r.get('step_by_step_seconds', 0):>6.1f}  {v['accepted']}")
    lines += IG.table_lines(rec.get("gemm_rows"))
    for r in rec.get("gemm") or []:
        if isinstance(r, dict) and "ratio" in r:
            lines.append(f"gemm {r['m']}x{r['k']}x{r['n']}: {r['invariant_tflops']:.0f} vs {r['cublas_tflops']:.0f} "
                         f"TFLOP/s ({r['ratio']:.2f})")
    for r in rec.get("step") or []:
        if isinstance(r, dict) and "speed_ratio" in r:
            lines.append(f"step N={r['tokens']}: {r['invariant_ms']:.0f} vs {r['default_ms']:.0f} ms "
                         f"({r['speed_ratio']:.2f} of the default's speed)")
    for r in rec.get("verify") or []:
        if isinstance(r, dict) and "ms" in r:
            lines.append(f"verify inv={r['batch_invariant']} canvases={r['canvases']}: {r['ms']:.1f} ms")
    e = rec.get("e2e") or {}
    for r in e.get("runs", []) if isinstance(e, dict) else []:
        lines.append(f"e2e inv={r['batch_invariant']} K={r['speculate']}: {r['seconds']:.1f} s, NFE {r['nfe']}, "
                     f"{r['ms_per_token']:.1f} ms/token, identical {r['identical_to_step_by_step']}")
    return "\n".join(lines)
