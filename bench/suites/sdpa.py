"""Which SDPA kernels serve Mosaic's attention layouts, and the ring's partial attention (GPU).

    python -m bench sdpa --out DIR [--only probe partial]     # one H200, seconds

Two diagnostics:
  probe    q contiguous or a strided view (as Mosaic's [N, H, hd] rows viewed as [1, H, N, hd]),
           K/V strided, each backend (flash, cuDNN) alone at 8k and 32k tokens, 32 heads of 128,
           so that a kernel that declines a layout shows as an error with its warnings
  partial  partial attention (the ring's per-piece kernel, kernels/reference.attention_partial)
           through each SDPA backend that returns a log-sum-exp: time, TFLOP/s and error
           against SDPA over the same keys (LLaDA-8B heads: 16,384 queries x 65,536 keys)"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F

from mosaic.kernels import reference as R

PARTS = ("probe", "partial")


def add_arguments(ap):
    ap.add_argument("--only", nargs="*", choices=PARTS)


def probe() -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    res = {"cudnn_version": torch.backends.cudnn.version()}
    for n in (8192, 32768):
        for layout in ("q_strided", "q_contiguous"):
            q = torch.randn(n, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(0, 1)[None]
            if layout == "q_contiguous":
                q = q.contiguous()
            k = torch.randn(n, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(0, 1)[None]
            v = torch.randn(n, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(0, 1)[None]
            for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                key = f"{n}/{layout}/{name}"
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    try:
                        with sdpa_kernel([be]):
                            F.scaled_dot_product_attention(q, k, v)
                            torch.cuda.synchronize()
                            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                            s.record()
                            for _ in range(3):
                                F.scaled_dot_product_attention(q, k, v)
                            e.record()
                            torch.cuda.synchronize()
                        res[key] = {"ms": s.elapsed_time(e) / 3}
                    except RuntimeError as ex:
                        res[key] = {"error": str(ex)[:400]}
                    res[key]["warnings"] = [str(x.message)[:400] for x in w]
                print(key, res[key], flush=True)
    return res


def partial(nq: int = 16384, nk: int = 65536, heads: int = 32, hd: int = 128, reps: int = 5) -> dict:
    torch.manual_seed(0)
    q = torch.randn(nq, heads, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(nk, heads, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])[0].transpose(0, 1).float()
    saved = list(R.PARTIAL_BACKENDS)
    res = {"queries": nq, "keys": nk, "heads": heads, "head_dim": hd}
    try:
        for name in ("cudnn", "flash"):
            R.PARTIAL_BACKENDS[:] = [name]
            o, lse = R.attention_partial(q, k, v)   # warm-up
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(reps):
                o, lse = R.attention_partial(q, k, v, native=True)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t) / reps * 1e3
            res[name] = {"ms": ms, "tflops": 4 * nq * nk * hd * heads / ms / 1e9,
                         "rel_err": ((o.float() - ref).norm() / ref.norm()).item(), "lse_shape": list(lse.shape)}
    finally:
        R.PARTIAL_BACKENDS[:] = saved
    return res


def run(args, rec) -> dict:
    for name in args.only or PARTS:
        rec.case(name, {"probe": probe, "partial": partial}[name], into="parts")
    return rec


def table(rec) -> str:
    lines = []
    for name, r in rec.get("parts", {}).items():
        if "error" in r and name == "partial":
            lines.append(f"partial: {r['error']}")
        elif name == "probe":
            lines += [f"{k:<28} {v.get('ms', 0):8.2f} ms {v.get('error', '')[:80]}" for k, v in r.items()
                      if isinstance(v, dict)]
        else:
            lines += [f"partial {b}: {x['ms']:.1f} ms, {x['tflops']:.0f} TFLOP/s, rel err vs SDPA {x['rel_err']:.2e}"
                      for b, x in r.items() if isinstance(x, dict)]
    return "\n".join(lines)
