"""Partial attention (the ring's per-piece kernel, kernels/reference.attention_partial) through
each SDPA backend that returns a log-sum-exp: time, TFLOP/s and error against SDPA over the same
keys. The run behind gpu/partial_cudnn_check.log (one H200, seconds):

    python bench/partial_check.py          # LLaDA-8B heads: 16,384 queries x 65,536 keys, 32 x 128
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from mosaic.kernels import reference as R  # noqa: E402


def main(nq: int = 16384, nk: int = 65536, heads: int = 32, hd: int = 128, reps: int = 5):
    torch.manual_seed(0)
    q = torch.randn(nq, heads, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(nk, heads, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])[0].transpose(0, 1).float()
    saved = list(R.PARTIAL_BACKENDS)
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
            err = ((o.float() - ref).norm() / ref.norm()).item()
            print(f"{name}: {ms:.1f} ms, {4 * nq * nk * hd * heads / ms / 1e9:.0f} TFLOP/s, "
                  f"rel err vs SDPA {err:.2e}, lse {tuple(lse.shape)}")
    finally:
        R.PARTIAL_BACKENDS[:] = saved


if __name__ == "__main__":
    main()
