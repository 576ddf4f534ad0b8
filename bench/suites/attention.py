"""Mosaic's Triton attention against PyTorch's SDPA (flash, cuDNN) and FlashInfer (GPU).

One GPU, bf16.
Shapes: LLaDA-8B (32 q heads / 32 kv heads / 128) and Dream-7B (28 / 4 / 128), nq = Nk = 8k, 32k,
128k, plus a short query chunk (400 rows) against 180k keys. Per case and kernel: median time
(triton.testing.do_bench; 128k cases: 1 warm-up + 3 timed calls, ~0.5-1 s each) and TFLOP/s by
attention_flops (4 nq Nk hd Hq x density). Block-sparse at densities 1.0/0.5/0.2/0.1 (random
128 x 128 layouts that keep the diagonal) at 32k and 128k. Relative error against an fp32
reference on the 8k shapes, the bf16 matmul rate (8192^3 torch.mm) as the compute ceiling, and
an int64-offset check (Nk * Hkv * hd > 2^31, last: a bad address would end the CUDA context).

    python -m bench attention --out DIR [--quick]    # ~3-4 min on an H200

Every record is appended to DIR/attention.json (`records`) as soon as it exists; a failing case is
recorded with its error and the others still run. A short table is printed last.
"""

from __future__ import annotations

import time
import traceback

import torch
import torch.nn.functional as F

from bench.lib.floors import matmul_rate as measured_matmul_rate
from bench.lib.measure import bench_ms, free
from mosaic.kernels import reference as R
from mosaic.kernels.attention import attention_flops, attention_into, num_splits
from mosaic.kernels.attention_layout import random_layout
from mosaic.kernels.attention_ref import attention_ref

MODELS = {"llada": (32, 32, 128), "dream": (28, 4, 128)}
BF16 = torch.bfloat16
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: a smoke run of the plumbing only
try:
    import flashinfer
except Exception as _e:   # not installed (wheels are not carried by default): reported in the header
    flashinfer, FLASHINFER_ERROR = None, f"not available: {type(_e).__name__}: {_e}"[:200]


class Log:
    """The record's `records` list: each case appended, saved and printed as soon as it exists."""

    def __init__(self, rec):
        self.rec = rec
        rec.setdefault("records", [])
        rec.save()

    def add(self, rec: dict) -> dict:
        self.rec["records"].append(rec)
        self.rec.save()
        ms, tf, err = rec.get("ms"), rec.get("tflops"), rec.get("rel_err")
        print(f"  {rec['case']:<26} {rec['impl']:<22} "
              + (f"{ms:9.3f} ms {tf:6.0f} TF/s" if ms is not None else f"{'':23}")
              + (f"  err {err:.2e}" if err is not None else "")
              + (f"  ERROR {rec['error'][:120]}" if "error" in rec else ""), flush=True)
        return rec


def timeit(fn, big: bool) -> float:
    if DEV == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    if not big:
        return bench_ms(fn, warmup=25, rep=200)
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[1]


def _n(x: int) -> str:
    return f"{x // 1024}k" if x % 1024 == 0 else str(x)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).norm() / ref.norm())


def make(nq, nk, hq, hkv, hd, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(nq, hq * hd, device=DEV, dtype=BF16, generator=g)       # a planned [n, Hq*hd] buffer
    k = torch.randn(nk, hkv, hd, device=DEV, dtype=BF16, generator=g)
    v = torch.randn(nk, hkv, hd, device=DEV, dtype=BF16, generator=g)
    return q.view(nq, hq, hd), k, v


def impls(q, k, v, out):
    """name -> zero-argument callable writing (or returning) the attention of q, k, v."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qq, hkv, g = R._stack_groups(q, k.shape[1])
    qc = qq.contiguous()
    kk, vv = k.transpose(0, 1)[None], v.transpose(0, 1)[None]

    def backend(b):
        def fn():
            with sdpa_kernel([b]):
                return F.scaled_dot_product_attention(qc, kk, vv)
        return fn

    fns = {"sdpa (reference.attention)": lambda: R.attention(out, q, k, v, cudnn=False),
           "sdpa flash only": backend(SDPBackend.FLASH_ATTENTION),
           "sdpa cudnn": backend(SDPBackend.CUDNN_ATTENTION),
           "mosaic triton": lambda: attention_into(out, q, k, v, impl="triton", tma=False),
           "mosaic triton tma": lambda: attention_into(out, q, k, v, impl="triton", tma=True)}
    if flashinfer is not None:
        fns["flashinfer single_prefill"] = lambda: flashinfer.single_prefill_with_kv_cache(q, k, v, causal=False)
    return fns


def result_of(name, fn, out):
    o = fn()
    if o is None:
        return out.view(out.shape[0], -1)
    if o.dim() == 4:   # SDPA [1, Hkv, G*nq, hd] -> [nq, Hq*hd]
        nq = out.shape[0]
        return R._unstack_groups(o, nq, o.shape[1], o.shape[2] // nq).reshape(nq, -1)
    return o.reshape(o.shape[0], -1)


def dense_case(log, model, nq, nk, check=False, quick=False):
    hq, hkv, hd = MODELS[model]
    case = f"{model} {_n(nq)}x{_n(nk)}"
    q, k, v = make(nq, nk, hq, hkv, hd)
    out = torch.empty(nq, hq * hd, device=DEV, dtype=BF16)
    ref = None
    if check:
        ref = torch.empty(nq, hq * hd, device=DEV, dtype=torch.float32)
        attention_ref(ref, q, k, v)
    flops = attention_flops(nq, nk, hq, hd)
    big = nq * nk >= 2**34
    for name, fn in impls(q, k, v, out).items():
        rec = {"case": case, "model": model, "nq": nq, "nk": nk, "hq": hq, "hkv": hkv, "hd": hd, "impl": name,
               "splits": num_splits(nq, hq, nk) if name.startswith("mosaic") else None}
        try:
            if ref is not None:
                rec["rel_err"] = rel_err(result_of(name, fn, out), ref)
            rec["ms"] = timeit(fn, big)
            rec["tflops"] = flops / rec["ms"] / 1e9
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        log.add(rec)
        free()
    if nq < 1024:   # short chunk: the split heuristic against fixed splits
        for s in (1, 2, 4, 8):
            rec = {"case": case, "impl": f"mosaic triton splits={s}", "nq": nq, "nk": nk, "splits": s}
            try:
                rec["ms"] = timeit(lambda s=s: attention_into(out, q, k, v, impl="triton", splits=s), big)
                rec["tflops"] = flops / rec["ms"] / 1e9
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            log.add(rec)


def sparse_case(log, model, n, densities, check=False):
    """check: relative error against the fp32 reference as well (8k only: the masked oracle is slow)."""
    hq, hkv, hd = MODELS[model]
    heads = "q" if hkv == hq else "kv"
    q, k, v = make(n, n, hq, hkv, hd, seed=1)
    out = torch.empty(n, hq * hd, device=DEV, dtype=BF16)
    big = n * n >= 2**34
    for dens in densities:
        lay = random_layout(hq if heads == "q" else hkv, n, n, 128, 128, dens, heads, seed=2, device=DEV)
        flops = attention_flops(n, n, hq, hd, lay.density())
        rec = {"case": f"{model} {_n(n)} sparse", "impl": f"mosaic sparse d={dens}", "density": lay.density(),
               "heads_per_layout": heads, "nq": n, "nk": n}
        try:
            if check:
                ref = torch.empty(n, hq * hd, device=DEV, dtype=torch.float32)
                attention_ref(ref, q, k, v, layout=lay)
                attention_into(out, q, k, v, layout=lay, impl="triton")
                rec["rel_err"] = rel_err(out, ref)
                del ref
            rec["ms"] = timeit(lambda: attention_into(out, q, k, v, layout=lay, impl="triton"), big)
            rec["tflops"] = flops / rec["ms"] / 1e9   # useful FLOPs: the tiles computed
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        log.add(rec)
        if flashinfer is not None:
            flashinfer_sparse(log, rec["case"], q, k, v, lay, flops, big)
        free()


def flashinfer_sparse(log, case, q, k, v, lay, flops, big):
    """FlashInfer's BlockSparseAttentionWrapper takes one layout for every head: layout head 0's."""
    rec = {"case": case, "impl": f"flashinfer sparse d={lay.density():.2f} (head 0's layout)"}
    try:
        ip = lay.indptr[0].to(torch.int32)
        idx = lay.indices[int(ip[0]): int(ip[-1])].to(torch.int32)
        ws = torch.empty(128 * 2**20, dtype=torch.uint8, device=DEV)
        w = flashinfer.BlockSparseAttentionWrapper(ws)
        w.plan(ip - ip[0], idx, q.shape[0], k.shape[0], lay.block_q, lay.block_k, q.shape[1], k.shape[1],
               q.shape[2])
        rec["ms"] = timeit(lambda: w.run(q, k, v), big)
        rec["tflops"] = flops / rec["ms"] / 1e9
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    log.add(rec)


def int64_check(log):
    """Nk * Hkv * hd = 2.16e9 > 2^31 elements: keys past 2^21 need 64-bit offsets (8.6 GB of K/V),
    through pointer loads and through TMA descriptors."""
    nq, nk, hq, hkv, hd = 256, 2**21 + 2**14, 8, 8, 128
    base = {"case": "int64 offsets", "nq": nq, "nk": nk, "elements": nk * hkv * hd}
    try:
        q, k, v = make(nq, nk, hq, hkv, hd, seed=3)
        k[-2**14:] *= 4   # make the keys past 2^31 elements matter
        ref = torch.empty(nq, hq * hd, device=DEV, dtype=torch.float32)
        attention_ref(ref, q, k, v)
    except Exception as e:
        log.add({**base, "impl": "fp32 reference", "error": f"{type(e).__name__}: {str(e)[:600]}"})
        return
    out = torch.empty(nq, hq * hd, device=DEV, dtype=BF16)
    for tma in (False, True):
        rec = {**base, "impl": "mosaic triton" + (" tma" if tma else "")}
        try:
            out.fill_(float("nan"))
            attention_into(out, q, k, v, impl="triton", tma=tma)
            rec["rel_err"] = rel_err(out, ref)
            rec["ms"] = timeit(lambda tma=tma: attention_into(out, q, k, v, impl="triton", tma=tma), False)
            rec["tflops"] = attention_flops(nq, nk, hq, hd) / rec["ms"] / 1e9
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        log.add(rec)


def matmul_rate(log):
    """The bf16 matmul ceiling of this device (bench.lib.floors; 512^3 on a CPU smoke run)."""
    n = 512 if DEV == "cpu" else 8192
    tf = measured_matmul_rate(n, DEV)
    log.add({"case": f"bf16 matmul {n}^3", "impl": "torch.mm", "ms": 2 * n**3 / tf / 1e9, "tflops": tf})


def add_arguments(ap):
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--sizes", help="comma-separated N (nq = Nk) for the dense cases")
    ap.add_argument("--sparse-sizes", help="comma-separated N for the block-sparse cases")
    ap.add_argument("--chunk", default="400x180000", help="short query chunk: ROWSxKEYS")
    ap.add_argument("--no-int64", action="store_true", help="skip the 8.6 GB int64-offset check")


def run(a, rec) -> dict:
    sizes = [2048, 4096] if a.quick else [8192, 32768, 131072]
    sparse_sizes = [4096] if a.quick else [32768, 131072]
    sizes = [int(x) for x in a.sizes.split(",")] if a.sizes else sizes
    sparse_sizes = [int(x) for x in a.sparse_sizes.split(",")] if a.sparse_sizes else sparse_sizes
    chunk_q, chunk_k = (int(x) for x in a.chunk.split("x"))
    chunk_k = min(chunk_k, 4096) if a.quick else chunk_k
    rec["shapes"] = {"sizes": sizes, "sparse_sizes": sparse_sizes, "chunk": [chunk_q, chunk_k]}
    rec["flashinfer"] = getattr(flashinfer, "__version__", "?") if flashinfer is not None else FLASHINFER_ERROR
    rec["capability"] = torch.cuda.get_device_capability() if DEV == "cuda" else None
    log = Log(rec)
    t0 = time.time()
    steps = [("matmul", lambda: matmul_rate(log))]
    for n in sizes:
        for m in MODELS:
            steps.append((f"dense {m} {n}", lambda m=m, n=n: dense_case(log, m, n, n, check=n == sizes[0])))
    for m in MODELS:
        steps.append((f"chunk {m}", lambda m=m: dense_case(log, m, chunk_q, chunk_k)))
    for m in MODELS:
        steps.append((f"sparse check {m}", lambda m=m: sparse_case(log, m, min(sizes[0], 8192), (0.2,), True)))
    for n in sparse_sizes:
        for m in MODELS:
            steps.append((f"sparse {m} {n}", lambda m=m, n=n: sparse_case(log, m, n, (1.0, 0.5, 0.2, 0.1))))
    if not a.no_int64:
        steps.append(("int64", lambda: int64_check(log)))
    for name, fn in steps:
        try:
            fn()
        except Exception:  # noqa: BLE001  (recorded; the other cases still run)
            log.add({"case": name, "impl": "-", "error": traceback.format_exc()[-800:]})
        free()
    from mosaic.kernels import attention_triton as T
    rec["autotune"] = {str(k): str(c) for k, c in T._tuned.cache.items()}
    rec["tma_failures"] = {str(k): v for k, v in T.tma_failures.items()}
    rec["seconds"] = time.time() - t0
    return rec


def table(rec) -> str:
    lines = [f"{'case':<26} {'impl':<40} {'ms':>9} {'TF/s':>6} {'rel err':>9}"]
    for r in rec["records"]:
        ms = f"{r['ms']:9.3f}" if r.get("ms") is not None else f"{'-':>9}"
        tf = f"{r['tflops']:6.0f}" if r.get("tflops") is not None else f"{'-':>6}"
        err = f"{r['rel_err']:9.1e}" if r.get("rel_err") is not None else ("    ERROR" if "error" in r else "")
        lines.append(f"{r['case']:<26} {r['impl'][:40]:<40} {ms} {tf} {err}")
    lines.append(f"autotune: {rec['autotune']}\ntma failures: {rec['tma_failures']}\ntotal {rec['seconds']:.0f} s")
    return "\n".join(lines)
