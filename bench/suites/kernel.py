"""The fused masked-logits kernel against the torch path and a bare cuBLAS matmul (GPU).

    python -m bench kernel --out DIR [--quick]

At the three models' (d, V), M masked rows of 1k, 16k and 128k (--quick: 1k): the fused kernel
(kernels/masked_logits.fused_reduce), the plain torch path (index_select + mm + softmax + max)
and a bare cuBLAS bf16 matmul of the same shape; do_bench medians, TFLOP/s from 2·M·d·V, the
extra device bytes of each, token agreement and confidence error against the torch path."""

from __future__ import annotations

import torch

from bench.lib.measure import bench_ms, free
from mosaic.kernels.masked_logits import FusedSpec, fused_reduce, workspace_rows

SHAPES = {"llada-8b": (4096, 126464), "dream-7b": (3584, 152064), "llada-moe-7b": (2048, 157184)}


def add_arguments(ap):
    ap.add_argument("--quick", action="store_true", help="M = 1024 only")
    ap.add_argument("--masked", type=int, nargs="*", default=None, help="masked rows M (default 1k 16k 128k)")


def _bench(fn, big: bool) -> float:
    return bench_ms(fn, warmup=20 if big else 50, rep=100 if big else 300)


def _extra(fn) -> int:
    """Peak bytes allocated by one call beyond what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def run(args, rec) -> dict:
    ms = args.masked or ((1024,) if args.quick else (1024, 16384, 131072))
    rec["rows"] = rows = []
    for name, (d, V) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(V, d, device="cuda", generator=g) * 0.02).bfloat16()
        for m in ms:
            rows.append(one(name, d, V, m, w, g))
            rec.save()
            free()
        del w
        free()
    return rec


def one(name, d, V, m, w, g) -> dict:
    n = m + m // 4
    x = torch.randn(n, d, device="cuda", generator=g).bfloat16()
    idx = torch.randperm(n, device="cuda", generator=g)[:m]
    outs = {"x0": torch.empty(m, dtype=torch.long, device="cuda"),
            "conf": torch.empty(m, dtype=torch.bfloat16, device="cuda")}
    ws = torch.empty(workspace_rows(m), 8, device="cuda")
    spec = FusedSpec()

    def fused():
        fused_reduce(x, idx, w, spec, outs, ws)

    def plain():
        lg = x.index_select(0, idx) @ w.t()
        return torch.softmax(lg, dim=-1).max(dim=-1)

    fused()  # compile + autotune (keyed on d only)
    conf_ref, x0_ref = plain()
    agree = float((outs["x0"] == x0_ref).float().mean())
    conf_err = float((outs["conf"].float() - conf_ref.float()).abs().max())
    conf_ref = x0_ref = None
    big = m >= 100000
    rec = {"model": name, "d": d, "V": V, "M": m, "token_agreement": agree, "conf_max_abs_err": conf_err,
           "fused_ms": _bench(fused, big), "fused_extra_bytes": _extra(fused) + ws.numel() * 4}
    free()
    rec["torch_ms"] = _bench(plain, big)
    rec["torch_extra_bytes"] = _extra(plain)
    free()
    h = x.index_select(0, idx)
    out = torch.empty(m, V, dtype=torch.bfloat16, device="cuda")
    rec["cublas_ms"] = _bench(lambda: torch.mm(h, w.t(), out=out), big)
    flop = 2.0 * m * V * d
    rec["fused_tflops"] = flop / rec["fused_ms"] / 1e9
    rec["cublas_tflops"] = flop / rec["cublas_ms"] / 1e9
    rec["fused_vs_cublas"] = rec["cublas_ms"] / rec["fused_ms"]
    rec["fused_vs_torch"] = rec["torch_ms"] / rec["fused_ms"]
    print(f"  {name} M={m}: fused {rec['fused_ms']:.2f} ms ({rec['fused_tflops']:.0f} TF/s, "
          f"{rec['fused_vs_cublas']:.0%} of cuBLAS), torch {rec['torch_ms']:.2f} ms, "
          f"extra {rec['fused_extra_bytes'] / 2**20:.2f} MiB vs {rec['torch_extra_bytes'] / 2**30:.1f} GiB, "
          f"agree {agree:.4f}", flush=True)
    return rec


def table(rec) -> str:
    return "\n".join(f"{'kernel':<8} {r['model']:<12} M={r['M']:>7} fused {r['fused_ms']:7.2f} ms "
                     f"({r['fused_vs_cublas']:.0%} cuBLAS, {r['fused_vs_torch']:.2f}x torch) extra "
                     f"{r['fused_extra_bytes'] / 2**20:.2f} MiB" for r in rec["rows"])
