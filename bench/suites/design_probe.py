"""Kernel alternatives behind this round's design choices, measured side by side (GPU).

    python -m bench design_probe --out DIR [--only gemm moe attention rng]

  gemm       LLaDA-8B's per-layer linear layers at 32 / 64 / 512 / 2048 rows: separate q, k, v,
             gate, up (today) against fused qkv and gate|up weights, weights [out, in] (F.linear)
             and pre-transposed [in, out] (torch.mm), bf16 reduced-precision reduction on and
             off (cuBLAS's split-K choice); the layer's weight bytes at the measured copy rate
             are the floor.
  moe        one MoE layer's experts (LLaDA2-mini: 256 experts of F 512, top-8; LLaDA-MoE: 64 of
             F 1024, top-8) at 32 / 256 / 1024 rows: the per-expert loop with host counts (today),
             torch._grouped_mm over rows sorted by expert (no host sync), beside the floor (bytes
             of the experts the rows reach at the copy rate).
  attention  batched block attention: b sequences of 32 query rows each against their own
             1k-1.5k keys (LLaDA-8B heads): one SDPA per sequence (today), one padded SDPA with a
             mask, the flash and memory-efficient varlen kernels (cu_seqlens), flex_attention;
             pool_*: Mosaic's batched step as it runs (kernels/varlen.py: keys in a pool with free
             rows between sequences, flash with seqused_k, Mosaic's Triton varlen kernel).
  rng        torch's CUDA generator inside a captured graph: replays continue the eager stream.

Each part records its error instead of stopping the run."""

from __future__ import annotations

import math
import traceback

import torch
import torch.nn.functional as F

from bench.lib.floors import matmul_rate
from bench.lib.measure import bench_ms, free, graph_ms

PARTS = ("gemm", "moe", "attention", "rng")


def add_arguments(ap):
    ap.add_argument("--only", nargs="*", choices=PARTS, default=list(PARTS))


def _copy_GBps() -> float:
    a = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a), warmup=5, rep=50)
    return 2 * a.numel() / ms / 1e6       # read + write


def gemm(rec):
    d, F_, rows = 4096, 12288, []
    dev, bf = "cuda", torch.bfloat16
    w = {k: torch.randn(*s, device=dev, dtype=bf) * 0.02 for k, s in
         (("q", (d, d)), ("k", (d, d)), ("v", (d, d)), ("o", (d, d)), ("g", (F_, d)), ("u", (F_, d)), ("dn", (d, F_)))}
    qkv = torch.cat([w["q"], w["k"], w["v"]])
    gu = torch.cat([w["g"], w["u"]])
    wt = {k: v.t().contiguous() for k, v in w.items()}
    qkv_t, gu_t = qkv.t().contiguous(), gu.t().contiguous()
    layer_bytes = sum(v.numel() for v in w.values()) * 2
    bw = rec["copy_GBps"]
    for n in (32, 64, 512, 2048):
        x = torch.randn(n, d, device=dev, dtype=bf)
        h = torch.randn(n, F_, device=dev, dtype=bf)

        def separate():
            for k in ("q", "k", "v", "o", "g", "u"):
                F.linear(x, w[k])
            F.linear(h, w["dn"])

        def fused():
            F.linear(x, qkv)
            F.linear(x, w["o"])
            F.linear(x, gu)
            F.linear(h, w["dn"])

        def fused_t():
            torch.mm(x, qkv_t)
            torch.mm(x, wt["o"])
            torch.mm(x, gu_t)
            torch.mm(h, wt["dn"])

        row = {"rows": n, "floor_ms": layer_bytes / bw / 1e6}
        for red in (True, False):
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = red
            tag = "" if red else "_noreduced"
            for name, fn in (("separate", separate), ("fused", fused), ("fused_t", fused_t)):
                row[name + tag + "_ms"] = _graph_ms(fn)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        # fused == separate bit for bit? (same columns of one GEMM vs three GEMMs)
        a = F.linear(x, qkv)
        b = torch.cat([F.linear(x, w[k]) for k in "qkv"], dim=1)
        row["fused_qkv_bits_equal"] = bool(torch.equal(a, b))
        a = F.linear(x, gu)
        b = torch.cat([F.linear(x, w["g"]), F.linear(x, w["u"])], dim=1)
        row["fused_gu_bits_equal"] = bool(torch.equal(a, b))
        rows.append(row)
    rec["gemm"] = rows


def _graph_ms(fn, reps: int = 20) -> float:
    """ms of fn() replayed in a CUDA graph of `reps` calls (launch gaps removed), median of runs."""
    return graph_ms(fn, reps, lambda replay: bench_ms(replay, warmup=3, rep=30))


def moe(rec):
    out = []
    for name, E, F_, k, d in (("llada2-mini", 256, 512, 8, 2048), ("llada-moe-7b", 64, 1024, 8, 2048)):
        dev, bf = "cuda", torch.bfloat16
        w_gu = torch.randn(E, 2 * F_, d, device=dev, dtype=bf) * 0.02        # [E, 2F, d]
        w_dn = torch.randn(E, d, F_, device=dev, dtype=bf) * 0.02            # [E, d, F]
        w_gu_t = w_gu.transpose(1, 2).contiguous()                            # [E, d, 2F]
        w_dn_t = w_dn.transpose(1, 2).contiguous()                            # [E, F, d]
        has_gmm = hasattr(torch, "_grouped_mm")
        for n in (32, 256, 1024):
            x = torch.randn(n, d, device=dev, dtype=bf)
            logits = torch.randn(n, E, device=dev)
            top_i = logits.topk(k, dim=-1)[1]
            flat = top_i.reshape(-1)
            reached = int(torch.unique(flat).numel())
            expert_bytes = 3 * F_ * d * 2
            row = {"model": name, "rows": n, "experts_reached": reached,
                   "floor_ms": reached * expert_bytes / rec["copy_GBps"] / 1e6}

            def loop():
                order = torch.argsort(flat, stable=True)
                counts = torch.bincount(flat, minlength=E).tolist()
                r = 0
                y = torch.empty(n * k, d, device=dev, dtype=bf)
                for j, c in enumerate(counts):
                    if c == 0:
                        continue
                    idx = order[r:r + c]
                    xs = x[idx // k]
                    gu = xs @ w_gu[j].t()
                    a = F.silu(gu[:, :F_]) * gu[:, F_:]
                    y[idx] = a @ w_dn[j].t()
                    r += c
                return y

            row["loop_ms"] = bench_ms(loop, warmup=3, rep=20)
            if has_gmm:
                def grouped():
                    order = torch.argsort(flat, stable=True)
                    counts = torch.bincount(flat, minlength=E)
                    offs = torch.cumsum(counts, 0).to(torch.int32)
                    xs = x[order // k]
                    gu = torch._grouped_mm(xs, w_gu_t, offs=offs)                # [n*k, 2F]
                    a = F.silu(gu[:, :F_]) * gu[:, F_:]
                    ys = torch._grouped_mm(a, w_dn_t, offs=offs)                 # [n*k, d]
                    y = torch.empty_like(ys)
                    y[order] = ys
                    return y
                try:
                    ref = loop().float()
                    got = grouped().float()
                    row["grouped_rel_err"] = float((got - ref).norm() / ref.norm())
                    row["grouped_ms"] = bench_ms(grouped, warmup=3, rep=20)
                    row["grouped_graph_ms"] = _graph_ms(grouped, reps=5)
                except Exception as e:  # noqa: BLE001
                    row["grouped_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            out.append(row)
            rec.save()
        free()
    rec["moe"] = out


def attention(rec):  # noqa: C901
    H, hd, q_per = 32, 128, 32
    dev, bf = "cuda", torch.bfloat16
    out = []
    for b in (1, 16, 64):
        g = torch.Generator().manual_seed(b)
        lens = [1056 + int(torch.randint(0, 512, (1,), generator=g)) for _ in range(b)]
        Lmax = max(lens)
        qs = [torch.randn(1, H, q_per, hd, device=dev, dtype=bf) for _ in lens]
        ks = [torch.randn(1, H, L, hd, device=dev, dtype=bf) for L in lens]
        vs = [torch.randn(1, H, L, hd, device=dev, dtype=bf) for L in lens]
        row = {"batch": b, "keys_mean": sum(lens) / b, "queries_per_seq": q_per}
        flops = sum(4 * q_per * L * hd * H for L in lens)
        row["bytes"] = sum(2 * L * H * hd * 2 for L in lens)
        row["floor_ms"] = row["bytes"] / rec["copy_GBps"] / 1e6

        def loop():
            return [F.scaled_dot_product_attention(q, k_, v) for q, k_, v in zip(qs, ks, vs)]
        ref = torch.cat([o[0].transpose(0, 1).reshape(q_per, H * hd) for o in loop()])
        row["loop_ms"] = _graph_ms(loop, reps=5)
        # padded with a mask
        Q = torch.cat(qs)
        Kp = torch.zeros(b, H, Lmax, hd, device=dev, dtype=bf)
        Vp = torch.zeros_like(Kp)
        mask = torch.zeros(b, 1, 1, Lmax, dtype=torch.bool, device=dev)
        for i, L in enumerate(lens):
            Kp[i, :, :L] = ks[i][0]
            Vp[i, :, :L] = vs[i][0]
            mask[i, ..., :L] = True

        def padded():
            return F.scaled_dot_product_attention(Q, Kp, Vp, attn_mask=mask)
        try:
            got = padded().transpose(1, 2).reshape(b * q_per, H * hd)
            row["padded_err"] = float((got.float() - ref.float()).norm() / ref.float().norm())
            row["padded_ms"] = _graph_ms(padded, reps=5)
        except Exception as e:  # noqa: BLE001
            row["padded_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        # varlen: packed [T, H, hd] with cumulative lengths
        qv = torch.cat([q[0].transpose(0, 1) for q in qs])                    # [b*q, H, hd]
        kv_ = torch.cat([k_[0].transpose(0, 1) for k_ in ks])                 # [sum L, H, hd]
        vv = torch.cat([v[0].transpose(0, 1) for v in vs])
        cu_q = torch.arange(0, (b + 1) * q_per, q_per, device=dev, dtype=torch.int32)
        cu_k = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev, dtype=torch.int32)
        scale = 1 / math.sqrt(hd)

        def flash_varlen():
            return torch.ops.aten._flash_attention_forward(qv, kv_, vv, cu_q, cu_k, q_per, Lmax, 0.0, False,
                                                           False, scale=scale)[0]

        def eff_varlen():
            return torch.ops.aten._efficient_attention_forward(
                qv.unsqueeze(0), kv_.unsqueeze(0), vv.unsqueeze(0), None, cu_q, cu_k, q_per, Lmax, 0.0, 0,
                False, scale=scale)[0][0]
        for name, fn in (("flash_varlen", flash_varlen), ("efficient_varlen", eff_varlen)):
            try:
                got = fn().reshape(b * q_per, H * hd)
                row[name + "_err"] = float((got.float() - ref.float()).norm() / ref.float().norm())
                row[name + "_bits_equal_loop"] = bool(torch.equal(got, ref))
                row[name + "_ms"] = _graph_ms(fn, reps=5)
            except Exception as e:  # noqa: BLE001
                row[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            seq_k = torch.cat([torch.full((L,), i, device=dev, dtype=torch.int32) for i, L in enumerate(lens)])
            seq_q = torch.arange(b, device=dev, dtype=torch.int32).repeat_interleave(q_per)

            def same(b_, h_, qi, ki):
                return seq_q[qi] == seq_k[ki]
            bm = create_block_mask(same, None, None, b * q_per, int(cu_k[-1]), device=dev)
            flex = torch.compile(flex_attention)
            qf, kf, vf = (t.transpose(0, 1).unsqueeze(0) for t in (qv, kv_, vv))

            def fx():
                return flex(qf, kf, vf, block_mask=bm, scale=scale)
            got = fx()[0].transpose(0, 1).reshape(b * q_per, H * hd)
            row["flex_err"] = float((got.float() - ref.float()).norm() / ref.float().norm())
            row["flex_ms"] = bench_ms(fx, warmup=5, rep=30)
        except Exception as e:  # noqa: BLE001
            row["flex_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        _pooled(row, lens, qv, ks, vs, ref)
        row["flops"] = flops
        out.append(row)
        rec.save()
    rec["attention"] = out


def _pooled(row, lens, qv, ks, vs, ref):
    """Mosaic's batched step as it runs (kernels/varlen.py): the keys in a pool with 64 free rows
    between sequences (other requests' pages), each sequence addressed by its first row and key
    count; flash varlen (seqused_k) and Mosaic's Triton varlen kernel (batch-invariant mode)."""
    from mosaic.kernels import varlen as VL
    H, hd = qv.shape[1], qv.shape[2]
    starts = [sum(lens[:i]) + 64 * (i + 1) for i in range(len(lens))]
    K = torch.zeros(starts[-1] + lens[-1] + 64, H, hd, device="cuda", dtype=qv.dtype)
    V = torch.zeros_like(K)
    for s0, L, k_, v_ in zip(starts, lens, ks, vs):
        K[s0:s0 + L], V[s0:s0 + L] = k_[0].transpose(0, 1), v_[0].transpose(0, 1)
    ent = VL.entries([qv.shape[0] // len(lens)] * len(lens), starts, lens, "cuda", max_k=2048)
    out = torch.empty(qv.shape[0], H * hd, device="cuda", dtype=qv.dtype)
    for name in ("flash", "triton"):
        try:
            def fn(name=name):
                VL.attention_into(out, qv, K, V, ent, name)
            fn()
            row[f"pool_{name}_err"] = float((out.float() - ref.float()).norm() / ref.float().norm())
            row[f"pool_{name}_ms"] = _graph_ms(fn, reps=5)
        except Exception as e:  # noqa: BLE001
            row[f"pool_{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"


def rng(rec):
    res = {}
    g = torch.Generator(device="cuda")
    g.manual_seed(7)
    eager = [torch.rand(1000, device="cuda", generator=g) for _ in range(3)]
    out = torch.empty(1000, device="cuda")
    g.manual_seed(7)
    graph = torch.cuda.CUDAGraph()
    res["register_generator_state"] = hasattr(graph, "register_generator_state")
    try:
        if res["register_generator_state"]:
            graph.register_generator_state(g)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            out.copy_(torch.rand(1000, device="cuda", generator=g))   # warm-up draw (advances g)
        torch.cuda.current_stream().wait_stream(s)
        g.manual_seed(7)
        with torch.cuda.graph(graph):
            out.copy_(torch.rand(1000, device="cuda", generator=g))
        g.manual_seed(7)
        got = []
        for _ in range(3):
            graph.replay()
            got.append(out.clone())
        res["replays_equal_eager_stream"] = [bool(torch.equal(a, b)) for a, b in zip(got, eager)]
        res["replays_differ"] = not torch.equal(got[0], got[1])
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    # the default generator
    try:
        torch.cuda.manual_seed(11)
        eager = [torch.rand(1000, device="cuda") for _ in range(2)]
        graph2 = torch.cuda.CUDAGraph()
        torch.cuda.manual_seed(11)
        with torch.cuda.graph(graph2):
            out.copy_(torch.rand(1000, device="cuda"))
        torch.cuda.manual_seed(11)
        got = []
        for _ in range(2):
            graph2.replay()
            got.append(out.clone())
        res["default_replays_equal_eager_stream"] = [bool(torch.equal(a, b)) for a, b in zip(got, eager)]
    except Exception as e:  # noqa: BLE001
        res["default_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rec["rng"] = res


def run(args, rec):
    if not torch.cuda.is_available():
        from bench.lib.record import SuiteError
        raise SuiteError("design_probe needs a CUDA GPU")
    rec["matmul_TFLOPs"] = matmul_rate()
    rec["copy_GBps"] = _copy_GBps()
    rec["has_grouped_mm"] = hasattr(torch, "_grouped_mm")
    rec.save()
    for part in args.only:
        try:
            globals()[part](rec)
        except Exception:  # noqa: BLE001
            rec[part + "_error"] = traceback.format_exc()[-2000:]
        rec.save()
        free()
    return rec


def table(rec) -> str:
    lines = [f"matmul {rec.get('matmul_TFLOPs', 0):.0f} TFLOP/s, copy {rec.get('copy_GBps', 0):.0f} GB/s"]
    for r in rec.get("gemm", []):
        lines.append("gemm " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    for r in rec.get("moe", []):
        lines.append("moe " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    for r in rec.get("attention", []):
        lines.append("attn " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                                        if not k.endswith("error")))
        lines += [f"  {k}: {v[:200]}" for k, v in r.items() if k.endswith("error")]
    lines.append(f"rng {rec.get('rng')}")
    for p in PARTS:
        if rec.get(p + "_error"):
            lines.append(f"{p} ERROR {rec[p + '_error'][-600:]}")
    return "\n".join(lines)
