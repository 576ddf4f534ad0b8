"""A modelled step time under block-sparse attention, from kernel times measured on one H200.

    step_ms = other_ms + sum over layers of attention_ms(layer)
    attention_ms = dense_ms                                  (a dense layer: SDPA)
                 = density * sparse_ms_per_density + estimate_ms    (a sparse layer)

with, for a step of N tokens (M masked) of a model with Hq heads of width hd, d hidden, F FFN
width, V vocabulary:
    dense_ms              = 4 N^2 Hq hd / SDPA_TFLOPS
    sparse_ms_per_density = 4 N^2 Hq hd / SPARSE_TFLOPS      (Mosaic's block-sparse kernel)
    estimate_ms           = the estimate's FLOPs at the SDPA rate (minmax / mean:
                            4 (N/b)^2 Hkv hd; rows: 4 N Hq (N/b) hd)
    other_ms              = (linear FLOPs 2 N (d (Hq hd + 2 Hkv hd) + Hq hd d + 3 d F) per layer
                            + logits 2 M d V) / OTHER_TFLOPS

The rates come from the committed H200 records (the figures are copied here so the installed
package needs no bench/ folder; tests/policy/test_sparse_cost.py checks them against the files):
  SDPA_TFLOPS   bench/results/gpu/bench_attention.json, "llada 128kx128k", sdpa: 469.15 ms
  SPARSE_TFLOPS the same file, "llada 128k sparse" at densities 0.10-1.0: a least-squares line
                through the origin, 749.10 ms per unit density (the four points within 5%)
  OTHER_TFLOPS  bench/results/gpu/bench_sparse.json "full": the llada-8b preset's dense
                full-depth step at 128k (prompt 64k, 64k masked) 18,139.57 ms, minus 32 x 469.15
                ms of attention = 3,126.7 ms for the rest, over its FLOPs
Check against the same file's sparse steps (every layer topk, block 128): keep 0.1 modelled
5,538 ms vs measured 5,576 ms (-0.7%), keep 0.2 7,926 vs 7,866 ms (+0.8%).

The model is labelled "modelled" wherever it is reported: it is the H200's measured rates
scaled by FLOPs. A small model (the bundled tiny-long: d 256, 4 layers) is bound by kernel
launches on a GPU, not FLOPs, so its modelled speed-up is the FLOP-bound limit, not a timing.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sparse_recall import Candidate

H200_SDPA_MS_128K = 469.15386962890625         # llada 128kx128k, sdpa (reference.attention)
H200_SPARSE_MS_PER_DENSITY_128K = 749.1024908151581
H200_DENSE_STEP_MS_128K = 18139.573505999975   # llada-8b full depth, 131,072 tokens, dense
LLADA_8B = dict(layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, ffn=12288, vocab=126464)
N128K = 131072


def attention_flops(tokens: int, heads: int, head_dim: int) -> float:
    """4 N^2 Hq hd: q k^T and p v over every (query, key) pair, bidirectional."""
    return 4.0 * tokens * tokens * heads * head_dim


def other_flops(tokens: int, masked: int, layers: int, hidden: int, heads: int, kv_heads: int,
                head_dim: int, ffn: int, vocab: int) -> float:
    """The step's non-attention matrix FLOPs: projections, FFN (gate, up, down), LM head rows."""
    per_layer = hidden * (heads * head_dim + 2 * kv_heads * head_dim) + heads * head_dim * hidden + 3 * hidden * ffn
    return 2.0 * tokens * per_layer * layers + 2.0 * masked * hidden * vocab


SDPA_TFLOPS = attention_flops(N128K, 32, 128) / H200_SDPA_MS_128K / 1e9
SPARSE_TFLOPS = attention_flops(N128K, 32, 128) / H200_SPARSE_MS_PER_DENSITY_128K / 1e9
OTHER_TFLOPS = other_flops(N128K, N128K // 2, **LLADA_8B) / (
    H200_DENSE_STEP_MS_128K - LLADA_8B["layers"] * H200_SDPA_MS_128K) / 1e9


@dataclass(frozen=True)
class Geometry:
    """The shapes a step's time depends on (ModelConfig's names) and its tokens."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tokens: int
    masked: int

    @classmethod
    def of(cls, cfg, tokens: int, masked: int | None = None) -> Geometry:
        return cls(cfg.num_layers, cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn,
                   cfg.vocab, tokens, tokens // 2 if masked is None else masked)

    @classmethod
    def llada_8b(cls, tokens: int = N128K) -> Geometry:
        return cls(**LLADA_8B, tokens=tokens, masked=tokens // 2)


def estimate_ms(g: Geometry, block: int, estimate: str) -> float:
    """Modelled ms of one layer's block estimate (the FLOPs above at the SDPA rate)."""
    nb = -(-g.tokens // block)
    if estimate == "rows":
        flops = 4.0 * g.tokens * g.heads * nb * g.head_dim
    else:
        flops = 4.0 * nb * nb * g.kv_heads * g.head_dim
    return flops / SDPA_TFLOPS / 1e9


def step_ms(g: Geometry, choices, block: int, estimate: str = "minmax") -> dict:
    """Modelled ms of one step: choices, one per layer, a Candidate or None (dense). Returns
    {"ms", "dense_ms", "speedup", "attention_ms": [per layer], "other_ms", "density": [per
    layer]}. Raises ValueError when len(choices) != g.layers."""
    if len(choices) != g.layers:
        raise ValueError(f"{len(choices)} layer choices for a {g.layers}-layer geometry")
    af = attention_flops(g.tokens, g.heads, g.head_dim)
    dense = af / SDPA_TFLOPS / 1e9
    other = other_flops(g.tokens, g.masked, g.layers, g.hidden, g.heads, g.kv_heads, g.head_dim, g.ffn,
                        g.vocab) / OTHER_TFLOPS / 1e9
    nkb = -(-g.tokens // block)
    att, dens = [], []
    for c in choices:
        if c is None or c.pattern == "dense":
            att.append(dense)
            dens.append(1.0)
        else:
            d = c.density(nkb)
            att.append(d * af / SPARSE_TFLOPS / 1e9 + estimate_ms(g, block, estimate))
            dens.append(d)
    total = other + sum(att)
    dense_total = other + g.layers * dense
    return {"ms": total, "dense_ms": dense_total, "speedup": dense_total / total, "attention_ms": att,
            "other_ms": other, "density": dens}


def scale_choices(choices, layers: int) -> list:
    """Per-layer choices of an L0-layer model applied to `layers` layers by relative depth:
    layer i takes the choice of layer floor(i * L0 / layers)."""
    n0 = len(choices)
    return [choices[i * n0 // layers] for i in range(layers)]


def candidate_cost(c: Candidate | None, g: Geometry, block: int, estimate: str) -> float:
    """Modelled ms of one layer's attention under c (None or dense: SDPA)."""
    return step_ms(Geometry(1, *[getattr(g, f) for f in ("hidden", "heads", "kv_heads", "head_dim", "ffn",
                                                          "vocab", "tokens", "masked")]),
                   [c], block, estimate)["attention_ms"][0]
