"""Weight offload, K/V streamed from host memory and FP8 on the GPU, with L_max verified.

    python -m bench offload --out DIR [--max-seconds 280] [--only pcie,gemm,...]

Parts, cheapest first; each is timed, and a part that would start past the deadline is skipped
and recorded as such (budget on an H200, model loads included):
  pcie      pinned host <-> device copy rate, 1 GiB x 5                                  ~3 s
  gemm      FP8 (rowwise torch._scaled_mm) vs bf16 GEMMs at LLaDA-8B shapes, M = 8,192;
            the activation quantizer (Triton) alone and with the GEMM                    ~5 s
  fp8_step  llada-8b full depth: one step at N = 8,192 (M = 4,096), bf16 vs every layer and
            the embedding in FP8; weight bytes; logit KL and argmax agreement vs bf16 at
            N = 2,048 (random preset weights: a numerics check, not a quality claim)    ~35 s
  offload   llada-8b, 4 layers, N = 65,536: one step resident vs weights offloaded       ~15 s
  kv        llada-8b, 2 layers, N = 262,144: resident (SDPA), resident (Mosaic's Triton
            kernel, the one the stream uses) and weights+kv (with one query chunk K and V
            never leave the device); each config's first step at N (cold: its plan, and for
            weights+kv with several query chunks the host pool's growth and pinning) and a
            second step (warm, what a server's later requests see); the overhead is warm vs
            warm against the same kernel; one more step of the Triton and streamed configs
            timed per op by CUDA events (op_ms: where the overhead goes)                 ~70 s
  kv_lmax   llada-8b, 1 layer, at the weights+kv L_max of 40 GiB (this GPU's context):
            weights+kv against resident with the same Triton kernel and the same chunks
            (resident needs ~105 GiB there: no budget), each timed with attention for the
            first two query chunks and for none, and the streamed one again with K and V
            written back without overlap; the full step is extrapolated as
            T(0) + chunks x (T(2) - T(0)) / 2 per mode (~75 GB of pinned host memory)   ~200 s
  lmax      L_max per mode predicted with this GPU's context, then one step at it with the
            device's used memory sampled on a thread (NVML, else cudaMemGetInfo):
            weights @ 24 GiB (1 layer), weights+kv @ 40 GiB (1 layer; ~70 GB of pinned
            host memory for K and V), weights @ 24 GiB full depth                       ~150 s
In the L_max steps attention is computed for the first two query chunks only (every buffer is
planned, mapped and written as in a full step; the skipped chunks repeat the same ops on the
same buffers), so a ~1-4 M token step fits in seconds; their times are not step times. With
offloaded layers a truncated model holds exactly the full model's device bytes (only the
embedding, LM head and staging slots are on the GPU)."""

from __future__ import annotations

import time

import torch

from bench.lib import engine as E
from bench.lib.floors import pcie
from bench.lib.measure import canvas, cuda_ms, free, median, meter, meter_source, timed
from bench.lib.offload_steps import AttentionSample, OpTimes, without_overlap
from mosaic import MosaicEngine, load
from mosaic.policy.capacity_modes import capacity_modes

GiB = 2**30


def step_ms(engine, x, reps=1):
    """Median wall-clock ms of `reps` steps (no warm-up: the callers warm up on a short canvas)."""
    return median(timed(E.step_fn(engine, x), repeat=reps, warmup=0))


def part_pcie():
    return pcie(GiB, 5)


def part_gemm(m=8192):
    from mosaic.kernels import fp8 as FP8
    shapes = {"q/k/v/o": (4096, 4096, 4), "gate/up": (12288, 4096, 2), "down": (4096, 12288, 1)}
    rows, tot16, tot8, tot8q = [], 0.0, 0.0, 0.0
    for name, (n, k, count) in shapes.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        w8, sw = FP8.quantize_weight(w)
        x8, sx = torch.empty(m, k, device="cuda", dtype=FP8.E4M3), torch.empty(m, device="cuda")
        FP8.quantize_rows(x8, sx, x)
        ms16 = cuda_ms(lambda: torch.mm(x, w.t(), out=out))
        ms8 = cuda_ms(lambda: FP8.scaled_mm(out, x8, sx, w8, sw))
        msq = cuda_ms(lambda: FP8.quantize_rows(x8, sx, x))
        msq_ref = cuda_ms(lambda: FP8.quantize_rows_ref(x8, sx, x))
        flops = 2.0 * m * n * k
        rows.append({"matrix": name, "m": m, "n": n, "k": k, "per_layer": count, "bf16_ms": ms16, "fp8_ms": ms8,
                     "quant_ms": msq, "quant_torch_ms": msq_ref, "bf16_tflops": flops / ms16 / 1e9,
                     "fp8_tflops": flops / ms8 / 1e9, "speedup": ms16 / ms8, "speedup_with_quant": ms16 / (ms8 + msq)})
        tot16, tot8, tot8q = tot16 + count * ms16, tot8 + count * ms8, tot8q + count * (ms8 + msq)
    return {"rows": rows, "layer_bf16_ms": tot16, "layer_fp8_ms": tot8, "layer_fp8_with_quant_ms": tot8q,
            "layer_speedup": tot16 / tot8, "layer_speedup_with_quant": tot16 / tot8q}


def part_fp8_step(n=8192):
    fp8cfg = {"ranges": [{"layers": [0, 31], "dtype": "fp8"}], "embed": "fp8"}
    bf = MosaicEngine(load("llada-8b", device="cuda"), {"progress": False})
    q = MosaicEngine(load("llada-8b", device="cuda"), {"progress": False, "precision": fp8cfg})
    x = canvas(bf.model, n, n // 2)
    for e in (bf, q):
        E.step(e, canvas(bf.model, 2048, 1024))
    rec = {"tokens": n, "bf16_ms": step_ms(bf, x, 3), "fp8_ms": step_ms(q, x, 3),
           "bf16_weight_bytes": bf.model.weight_bytes(), "fp8_weight_bytes": q.model.weight_bytes()}
    rec["speedup"] = rec["bf16_ms"] / rec["fp8_ms"]
    rec["weight_change"] = rec["fp8_weight_bytes"] / rec["bf16_weight_bytes"] - 1
    c = canvas(bf.model, 2048, 1024, seed=3)
    with torch.no_grad():
        a = E.forward_logits(bf, c)[c == bf.model.cfg.mask_id].float()
        b = E.forward_logits(q, c)[c == bf.model.cfg.mask_id].float()
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    rec["kl"] = float((la.exp() * (la - lb)).sum(-1).mean())
    rec["token_agreement"] = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    del bf, q, x, a, b
    free()
    return rec


def compare(n, layers, configs, warm_n=8192, warm_steps=0, op_times=()):
    """Per config: one step at N after a warm-up at warm_n (ms), and with warm_steps, that many
    more steps at N (warm_ms: the median; the first step at N also plans the new key and, for
    streamed K/V, grows and pins the host pool); for the configs named in op_times one more
    step timed per op (op_ms, OpTimes). A config named '... no overlap' runs without_overlap()."""
    model = load("llada-8b", device="cuda", num_layers=layers)
    x, w = canvas(model, n, n // 2), canvas(model, warm_n, warm_n // 2)
    rec = {"tokens": n, "layers": layers, "ms": {}, "engine_bytes_copied": {}}
    if warm_steps:
        rec["warm_ms"] = {}
    for name, kw in configs.items():
        e = MosaicEngine(model, {"progress": False, **kw})
        with without_overlap(name.endswith("no overlap")):
            E.step(e, w)                               # compile kernels, pin, plan once
            rec["ms"][name] = step_ms(e, x)
            if warm_steps:
                rec["warm_ms"][name] = step_ms(e, x, warm_steps)
            if name in op_times:
                probe = OpTimes()
                E.step(e, x, probe=probe)
                rec.setdefault("op_ms", {})[name] = probe.ms()
        rec["engine_bytes_copied"][name] = E.bytes_copied(e)
        rec.setdefault("chunks", {})[name] = E.last_chunks(e)
        E.place_resident(e)                        # the next engine finds the layers on the device
        E.clear_host_kv(e)
        warm = f", warm {rec['warm_ms'][name]:.0f} ms" if warm_steps else ""
        print(f"  N={n:,} {layers} layers {name}: {rec['ms'][name]:.0f} ms{warm}", flush=True)
        del e
        free()
    del model, x
    free()
    return rec


def part_offload():
    rec = compare(65536, 4, {"resident": {}, "weights": {"offload": "weights"}})
    rec["overhead"] = rec["ms"]["weights"] / rec["ms"]["resident"] - 1
    return rec


def part_kv():
    rec = compare(262144, 2, {"resident": {}, "resident triton": {"attention": "triton"},
                              "weights+kv": {"offload": "weights+kv"}}, warm_steps=1,
                  op_times=("resident triton", "weights+kv"))
    ms, warm = rec["ms"], rec["warm_ms"]
    rec["overhead_vs_sdpa"] = warm["weights+kv"] / warm["resident"] - 1
    rec["overhead_vs_same_kernel"] = warm["weights+kv"] / warm["resident triton"] - 1
    rec["overhead_vs_same_kernel_cold"] = ms["weights+kv"] / ms["resident triton"] - 1
    return rec


def _sampled(e, x):
    """{keep: ms} of one step with attention for the first `keep` query chunks, keep = 2 and 0,
    after an untimed step (its template key plans once; the host pool grows and is pinned)."""
    with AttentionSample(0):
        E.step(e, x)
    out = {}
    for keep in (2, 0):
        with AttentionSample(keep):
            out[keep] = step_ms(e, x)
    return out


def part_kv_lmax(budget="40GiB"):
    """Streamed K/V against resident with the same kernel and chunks at the weights+kv L_max
    of `budget` (module docstring: sampled steps, the full step extrapolated)."""
    model = load("llada-8b", device="cuda", num_layers=1)
    e = MosaicEngine(model, {"progress": False, "memory_budget": budget, "offload": "weights+kv"})
    b = E.budget(e)
    rep = capacity_modes(load("llada-8b", device="meta"), budget, ("weights+kv",), E.config(e),
                         context_bytes=b.context_bytes, workspace_bytes=b.workspace_bytes,
                         ratios=(1.0,))["modes"]["weights+kv"]
    n = rep["l_max"]
    half = max(1, n // 2)
    chunks = tuple(E.admit(e, 1, n, E.generation_config(e, max_new_tokens=half)).chunks)
    x = canvas(model, n, half)
    rec = {"budget": budget, "layers": 1, "l_max": n, "masked": half, "chunks": list(chunks), "ms": {}}
    for name in ("weights+kv", "resident triton"):
        if name != "weights+kv":    # the same kernel and chunks, resident (no budget: ~105 GiB)
            e = MosaicEngine(model, {"progress": False, "attention": "triton", "chunks": chunks})
        E.step(e, canvas(model, 8192, 4096))
        try:
            runs = {name: _sampled(e, x)}
        except Exception as ex:  # noqa: BLE001  (the other config's numbers are kept)
            rec["ms"][name] = {"error": repr(ex)[:400]}
            E.place_resident(e)
            E.clear_host_kv(e)
            del e
            free()
            continue
        if name == "weights+kv":                    # the same engine, K and V written back without overlap
            with without_overlap():
                runs["weights+kv no overlap"] = _sampled(e, x)
        for label, t in runs.items():
            full = t[0] + chunks[0] * (t[2] - t[0]) / 2
            rec["ms"][label] = {"attention_2_chunks": t[2], "attention_none": t[0], "full_step_extrapolated": full}
            print(f"  kv_lmax N={n:,} {label}: T(2) {t[2]:.0f} ms, T(0) {t[0]:.0f} ms, "
                  f"full step ~{full / 1e3:.0f} s", flush=True)
        if name == "weights+kv":
            rec["host_kv_bytes"] = E.host_kv_bytes(e)
            E.place_resident(e)
            E.clear_host_kv(e)
        del e
        free()
    s, r = rec["ms"]["weights+kv"], rec["ms"]["resident triton"]
    if "error" in s or "error" in r:
        return rec
    rec["overhead_sampled_step"] = s["attention_2_chunks"] / r["attention_2_chunks"] - 1
    rec["overhead_per_query_chunk"] = (s["attention_2_chunks"] - s["attention_none"]) / \
        (r["attention_2_chunks"] - r["attention_none"]) - 1
    rec["overhead_full_step_extrapolated"] = s["full_step_extrapolated"] / r["full_step_extrapolated"] - 1
    u = rec["ms"]["weights+kv no overlap"]
    rec["overhead_full_step_extrapolated_no_overlap"] = u["full_step_extrapolated"] / r["full_step_extrapolated"] - 1
    rec["write_back_saved_ms"] = u["attention_none"] - s["attention_none"]
    del model, x
    free()
    return rec


PLANS: dict = {}


def verify(mode, budget, layers, m):
    """One step at the mode's predicted L_max with the device's used memory sampled (meter m)."""
    model = load("llada-8b", device="cuda", num_layers=layers)
    e = MosaicEngine(model, {"progress": False, "memory_budget": budget, "offload": mode})
    # the engine's measured context and workspace (warm-up), charged as the capacity planner does
    b = E.budget(e)
    ctx, ws = b.context_bytes, b.workspace_bytes
    t = time.perf_counter()
    key = (mode, budget, ctx, ws)    # a truncated model with offloaded layers plans as the full one
    if key not in PLANS:
        PLANS[key] = capacity_modes(load("llada-8b", device="meta"), budget, (mode,), E.config(e),
                                    context_bytes=ctx, workspace_bytes=ws, ratios=(1.0,))["modes"][mode]
    rep = PLANS[key]
    n = rep["l_max"]
    half = max(1, n // 2)
    plan_s = time.perf_counter() - t
    adm = E.admit(e, 1, n, E.generation_config(e, max_new_tokens=half))
    x = canvas(model, n, half)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    with m, m.window() as w, AttentionSample(2) as a:
        E.step(e, x)
        torch.cuda.synchronize()
    secs = time.perf_counter() - t
    used = w.peak_bytes            # the device's used bytes less the other processes' (baseline)
    # context + PyTorch's peak reserved (weights, host arena) + the virtual-memory arena's pages
    counters = b.context_bytes + torch.cuda.max_memory_reserved() + E.vmm_peak_bytes(e)
    out = {"mode": mode, "budget": budget, "layers": layers, "l_max": n, "masked": half, "chunks": list(adm.chunks),
           "predicted_bytes": adm.predicted_bytes, "measured_used_bytes": used, "sampler": meter_source(m),
           "counters_bytes": counters, "budget_bytes": rep["budget_bytes"],
           "within_budget": used <= rep["budget_bytes"],
           "prediction_error": (adm.predicted_bytes - used) / used, "attention_calls": a.calls,
           "host_kv_bytes": E.host_kv_bytes(e), "host_weight_bytes": E.host_weight_bytes(e),
           "plan_seconds": plan_s, "step_seconds_sampled": secs, "transfer": rep["transfer"], "capacity": rep}
    print(f"  {mode} @ {budget}, {layers} layers: N={n:,} predicted {adm.predicted_bytes / GiB:.2f} GiB, "
          f"measured {used / GiB:.2f} GiB ({meter_source(m)}), {secs:.0f} s", flush=True)
    E.clear_host_kv(e)
    del e, model, x
    free()
    return out


def part_lmax(m, rec, deadline):
    runs = []
    for mode, budget, layers, cost in (("weights", "24GiB", 1, 25), ("weights+kv", "40GiB", 1, 60),
                                        ("weights", "24GiB", 32, 60)):
        if rec.elapsed() + cost > deadline:
            runs.append({"mode": mode, "budget": budget, "layers": layers, "skipped": "deadline"})
            continue
        try:
            runs.append(verify(mode, budget, layers, m))
        except Exception as ex:  # noqa: BLE001
            runs.append({"mode": mode, "budget": budget, "layers": layers, "error": repr(ex)[:400]})
            free()
    return runs


PARTS = {"pcie": (part_pcie, 5), "gemm": (part_gemm, 8), "fp8_step": (part_fp8_step, 45),
         "offload": (part_offload, 20), "kv": (part_kv, 70), "kv_lmax": (part_kv_lmax, 200)}


def add_arguments(ap):
    ap.add_argument("--max-seconds", type=float, default=280, help="parts that would end past it are skipped")
    ap.add_argument("--only", default="pcie,gemm,fp8_step,offload,kv,lmax,kv_lmax", help="comma-separated parts")


def run(args, rec) -> dict:
    m = meter(mode="device")       # the whole device; other processes' bytes are the baseline
    rec["base_used_bytes"] = m.set_baseline() if meter_source(m) == "nvml" else 0   # before our context
    for name in args.only.split(","):
        t = time.perf_counter()
        if name == "lmax":
            rec["lmax"] = part_lmax(m, rec, args.max_seconds)
        elif rec.elapsed() + PARTS[name][1] > args.max_seconds:
            rec[name] = {"skipped": "deadline"}
        else:
            try:
                rec[name] = PARTS[name][0]()
            except Exception as ex:  # noqa: BLE001
                rec[name] = {"error": repr(ex)[:400]}
                free()
        rec.setdefault("seconds", {})[name] = time.perf_counter() - t
        rec.save()
        print(f"[{name}: {rec['seconds'][name]:.0f} s, {rec.elapsed():.0f} s so far]", flush=True)
    return rec


def table(rec) -> str:  # noqa: C901
    lines = []
    p, g, s, o, k = (rec.get(x, {}) for x in ("pcie", "gemm", "fp8_step", "offload", "kv"))
    lines.append(f"offload on {rec.get('gpu')}")
    if "h2d_GBps" in p:
        lines.append(f"PCIe pinned: H2D {p['h2d_GBps']:.1f} GB/s, D2H {p['d2h_GBps']:.1f} GB/s")
    if "rows" in g:
        for r in g["rows"]:
            lines.append(f"GEMM {r['matrix']:<8} M={r['m']} N={r['n']} K={r['k']}: bf16 {r['bf16_ms']:.3f} ms "
                  f"({r['bf16_tflops']:.0f} TF/s), fp8 {r['fp8_ms']:.3f} ms ({r['fp8_tflops']:.0f} TF/s) "
                  f"{r['speedup']:.2f}x; +quant {r['quant_ms']:.3f} ms (torch {r['quant_torch_ms']:.3f}) "
                  f"{r['speedup_with_quant']:.2f}x")
        lines.append(f"GEMMs of one layer: {g['layer_speedup']:.2f}x, with activation quantization "
              f"{g['layer_speedup_with_quant']:.2f}x (target >= 1.6x)")
    if "speedup" in s:
        lines.append(f"step N={s['tokens']:,}: bf16 {s['bf16_ms']:.0f} ms, fp8 {s['fp8_ms']:.0f} ms: "
              f"{s['speedup']:.2f}x (target >= 1.3x); weights {s['bf16_weight_bytes'] / GiB:.2f} -> "
              f"{s['fp8_weight_bytes'] / GiB:.2f} GiB "
              f"({s['weight_change']:+.1%}, target <= -45%); KL {s['kl']:.2e}, "
              f"argmax agreement {s['token_agreement']:.3f}")
    if "overhead" in o:
        lines.append(f"offload weights, N={o['tokens']:,}, {o['layers']} layers: {o['ms']['resident']:.0f} -> "
              f"{o['ms']['weights']:.0f} ms ({o['overhead']:+.1%}, target <= 5%)")
    if "overhead_vs_sdpa" in k:
        ms = k.get("warm_ms", k["ms"])
        lines.append(f"streamed K/V, N={k['tokens']:,}, {k['layers']} layers (warm steps): resident "
              f"{ms['resident']:.0f} ms, resident triton {ms['resident triton']:.0f} ms, weights+kv "
              f"{ms['weights+kv']:.0f} ms ({k['overhead_vs_sdpa']:+.1%} vs SDPA, {k['overhead_vs_same_kernel']:+.1%} "
              f"vs the same kernel; target <= 10%)")
        lines.append(f"  chunks {k.get('chunks')}; first (cold) steps {k['overhead_vs_same_kernel_cold']:+.1%} "
                     f"vs the same kernel")
    if "op_ms" in k and {"weights+kv", "resident triton"} <= set(k["op_ms"]):
        a, b = k["op_ms"]["weights+kv"], k["op_ms"]["resident triton"]
        diff = sorted(((a.get(n, 0.0) - b.get(n, 0.0), n) for n in set(a) | set(b)), reverse=True)[:5]
        lines.append("  streamed minus resident triton per op (ms): " +
                     ", ".join(f"{n} {d:+.0f}" for d, n in diff))
    q = rec.get("kv_lmax", {})
    if "overhead_full_step_extrapolated" in q:
        lines.append(f"streamed K/V at the {q['budget']} L_max N={q['l_max']:,} (1 layer, chunks {q['chunks']}): "
                     f"{q['overhead_sampled_step']:+.1%} on the sampled step (2 query chunks), "
                     f"{q['overhead_per_query_chunk']:+.1%} per query chunk, "
                     f"{q['overhead_full_step_extrapolated']:+.1%} on the extrapolated full step vs the same kernel "
                     f"({q['overhead_full_step_extrapolated_no_overlap']:+.1%} without the write-back overlap, "
                     f"which saves {q['write_back_saved_ms']:.0f} ms)")
    for r in rec.get("lmax", []):
        if "l_max" in r:
            lines.append(f"L_max {r['mode']} @ {r['budget']} ({r['layers']} layers): {r['l_max']:,} tokens, predicted "
                  f"{r['predicted_bytes'] / GiB:.2f} GiB, measured {r['measured_used_bytes'] / GiB:.2f} GiB "
                  f"({r['sampler']}), within budget: {r['within_budget']}")
        else:
            lines.append(f"L_max {r['mode']} @ {r['budget']} ({r['layers']} layers): "
                         f"{r.get('skipped') or r.get('error')}")
    for name in ("pcie", "gemm", "fp8_step", "offload", "kv", "kv_lmax"):
        if isinstance(rec.get(name), dict) and ("error" in rec[name] or "skipped" in rec[name]):
            lines.append(f"{name}: {rec[name]}")
    return "\n".join(lines)
