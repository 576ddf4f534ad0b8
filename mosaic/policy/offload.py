"""Offload policy: which mode a request runs in, what each mode is charged, and the predicted
transfer-to-compute ratio (docs/OFFLOAD.md).

Modes, from least to most streamed:
  resident    every weight on the device (today's path)
  weights     layer weights in pinned host memory, copied `ahead` layers ahead into planned
              staging slots; the device is charged the embedding, LM head and final norm plus
              the slots (in the plan). Bit-identical tokens.
  weights+kv  and each layer's K and V in host memory, streamed back in key blocks during
              attention; the device floor is the residual x plus working buffers.
`offload: auto` takes the least streamed mode whose first step fits the budget (a mode that
fits with less streaming is never slower); a fixed mode is used as given.

The ratio compares, per layer, the bytes crossing PCIe at the measured pinned host-to-device
rate with the layer's matmul and attention FLOPs at the measured dense bf16 rate. Below 1 the
copies can hide behind compute (they run on their own stream); above 1 the step is
transfer-bound and slows down by about the ratio.
"""

from __future__ import annotations

from ..config import EngineConfig
from ..graph.streams import Offload

MODES = ("resident", "weights", "weights+kv")
# pinned host -> device copies measured on the project's H200 (`python -m bench offload` measures
# it again in every run and the engine can be given the measured value)
PCIE_BYTES_PER_S = 55e9
# dense bf16 rate reached by SDPA and the GEMMs on the H200 (RESULTS.md: attention ~600 TFLOP/s,
# matmul ceiling 700): the compute floor of a layer, so the ratio errs on the high side
COMPUTE_FLOPS_PER_S = 600e12


def offload_of(mode: str, config: EngineConfig, cfg=None) -> Offload | None:
    """The Offload a step of `mode` carries (None: resident); cfg (ModelConfig) sets the
    streamed-K/V query-chunk floor (kv_min_rows)."""
    if mode == "resident":
        return None
    kv = mode == "weights+kv"
    return Offload(ahead=config.prefetch_layers, kv=kv, kv_block_rows=config.kv_block_rows,
                   min_query_rows=kv_min_rows(cfg) if kv and cfg is not None else 0)


def kv_min_rows(cfg, pcie_bytes_per_s: float = PCIE_BYTES_PER_S,
                flops_per_s: float = COMPUTE_FLOPS_PER_S, itemsize: int = 2) -> int:
    """Query rows per attention chunk at which streaming K and V back costs no more time than
    the chunk's attention. A chunk of nq rows over N keys moves 2*N*kv_dim*itemsize bytes and
    computes 4*nq*N*q_dim FLOPs, so the copies hide when nq >= kv_dim*itemsize*flops /
    (2*q_dim*bandwidth), independent of N. LLaDA-8B in bf16: 10,909 rows (rounded up to a
    multiple of 1,024: 11,264); Dream-7B (kv_dim = q_dim / 7): 1,559 -> 2,048."""
    rows = cfg.kv_dim * itemsize * flops_per_s / (2 * cfg.q_dim * pcie_bytes_per_s)
    return int(-(-rows // 1024) * 1024)


def candidates(config: EngineConfig) -> list[str]:
    """Modes admission may try for a request, in order (auto: least streaming first)."""
    return {"off": ["resident"], "weights": ["weights"], "weights+kv": ["weights+kv"],
            "auto": list(MODES)}[config.offload]


def mode_of(offload: Offload | None) -> str:
    return "resident" if offload is None else offload.mode


def layer_flops(cfg, n_tokens: int) -> float:
    """Multiply-add FLOPs of one layer over n_tokens (projections, FFN or routed experts,
    attention) — what the copies of that layer can hide behind."""
    d, n = cfg.hidden, n_tokens
    proj = 2 * n * d * (2 * cfg.q_dim + 2 * cfg.kv_dim)
    ffn = 2 * n * 3 * d * cfg.ffn * (cfg.top_k if cfg.num_experts else 1)
    attn = 4.0 * n * n * cfg.head_dim * cfg.num_heads
    return proj + ffn + attn


def transfer_report(model, n_tokens: int, mode: str, attn_chunks: int = 1,
                    pcie_bytes_per_s: float = PCIE_BYTES_PER_S,
                    flops_per_s: float = COMPUTE_FLOPS_PER_S) -> dict:
    """Predicted bytes over PCIe and compute per layer for one step of `mode` (bytes, ms).

    weights: one layer's weights (the largest); weights+kv adds the layer's K and V written to
    host (2 * N * kv_dim * itemsize) and read back once per attention query chunk."""
    cfg = model.cfg
    item = model.dtype.itemsize
    layer = max(model.layer_bytes()) if mode != "resident" else 0
    kv = 2 * n_tokens * cfg.kv_dim * item if mode == "weights+kv" else 0
    transfer = layer + kv * (1 + attn_chunks)
    compute_ms = layer_flops(cfg, n_tokens) / flops_per_s * 1e3
    transfer_ms = transfer / pcie_bytes_per_s * 1e3
    return {"mode": mode, "tokens": n_tokens, "attn_chunks": attn_chunks,
            "transfer_bytes_per_layer": transfer, "transfer_ms_per_layer": transfer_ms,
            "compute_ms_per_layer": compute_ms,
            "transfer_to_compute": transfer_ms / compute_ms if compute_ms else float("inf"),
            "pcie_bytes_per_s": pcie_bytes_per_s, "flops_per_s": flops_per_s}
