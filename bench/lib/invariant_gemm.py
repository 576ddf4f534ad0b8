"""The batch-invariant matmul (mosaic/kernels/invariant_triton.matmul) against torch.mm (cuBLAS) at
LLaDA-8B's shapes and a block step's row counts: `python -m bench speculative --device cuda --only
gemm` (bench/suites/speculative.py's gemm part; `--tokens` with no value skips its large-M rows).

Per (M, K -> N), bf16: ms of each (replayed from a CUDA graph: the engine's steps are, so launch
gaps are not counted), GB/s (weights + x + out bytes / time: a small-M product is weight-bound),
the invariant kernel's speed as a fraction of torch.mm's, its tile, and whether its rows are the
bits of the same rows in a 2048-row product and of the first 8 rows computed alone (M = 1). With
--gemm-sweep, every tile of invariant_tiles.TILES the same way (which one the rule should pick)."""

from __future__ import annotations

import torch

from bench.lib.measure import free, graph_ms

SHAPES = ((4096, 4096), (4096, 2 * 12288), (12288, 4096), (4096, 126464))   # (K, N): q/k/v/o, gate+up, down, head
REF_ROWS = 2048
ALONE_ROWS = 8


def _name(t) -> str:
    return f"{t.bm}x{t.bn}x{t.bk} w{t.warps} s{t.stages}"


def _timed(T, x, w, o, ref, tile=None) -> dict:
    """ms, GB/s and bits of the invariant product of x with one tile (the rule's by default)."""
    ms = graph_ms(lambda: T.matmul(o, x, w, tile=tile))
    T.matmul(o, x, w, tile=tile)
    nbytes = (w.numel() + x.numel() + o.numel()) * x.element_size()
    return {"tile": _name(tile or T.tile_for(x, w.shape[0])), "ms": ms, "gb_s": nbytes / ms / 1e6,
            "same_as_2048_rows": bool(torch.equal(o, ref[: x.shape[0]]))}


def row(m: int, k: int, n: int, sweep: bool) -> dict:
    """One (M, K, N) row: torch.mm, the invariant product and its bits (module docstring)."""
    from mosaic.kernels import invariant_triton as T
    from mosaic.kernels.invariant_tiles import all_tiles
    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    xs = torch.randn(max(m, REF_ROWS), k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    ref = torch.empty(xs.shape[0], n, device="cuda", dtype=torch.bfloat16)
    T.matmul(ref, xs, w)
    x, o = xs[:m], torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    torch_ms = graph_ms(lambda: torch.mm(x, w.t(), out=o))
    out = {"m": m, "k": k, "n": n, "torch_ms": torch_ms, **_timed(T, x, w, o, ref)}
    out["torch_gb_s"] = out["gb_s"] * out["ms"] / torch_ms
    out["ratio"] = torch_ms / out["ms"]
    one = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    alone = True
    for r in range(min(m, ALONE_ROWS)):
        T.matmul(one, x[r:r + 1], w)
        alone &= bool(torch.equal(one[0], o[r]))
    out["same_as_alone"] = alone
    out["identical"] = alone and out["same_as_2048_rows"]
    if sweep:
        out["sweep"] = []
        for t in all_tiles(torch.bfloat16):
            s = _timed(T, x, w, o, ref, t)
            out["sweep"].append({**s, "ratio": torch_ms / s["ms"]})
    return out


def line(r: dict) -> str:
    return (f"gemm M={r['m']:>4} {r['k']:>5}->{r['n']:<6}: torch.mm {r['torch_ms'] * 1e3:7.1f} us "
            f"{r['torch_gb_s']:5.0f} GB/s | invariant {r['ms'] * 1e3:7.1f} us {r['gb_s']:5.0f} GB/s "
            f"({r['ratio']:.2f}x, tile {r['tile']}) | bits identical {r['identical']}")


def sweep_lines(r: dict) -> list[str]:
    return [f"    tile {s['tile']:<20} {s['ms'] * 1e3:7.1f} us {s['gb_s']:5.0f} GB/s ({s['ratio']:.2f}x) "
            f"same bits {s['same_as_2048_rows']}" for s in r.get("sweep", [])]


def table_lines(rows) -> list[str]:
    """The recorded rows (a failed part's record is skipped) as the suite's table prints them."""
    return [x for r in rows or [] if isinstance(r, dict) and "ratio" in r for x in (line(r), *sweep_lines(r))]


def table(ms, sweep: bool = False) -> list[dict]:
    """Every (M, shape) row, printed as it lands."""
    out = []
    for m in ms:
        for k, n in SHAPES:
            r = row(m, k, n, sweep)
            free()                                  # the head's 1 GiB of weights before the next shape
            out.append(r)
            print("  " + line(r), flush=True)
            for s in sweep_lines(r):
                print(s, flush=True)
    return out
