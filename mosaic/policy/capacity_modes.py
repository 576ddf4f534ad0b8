"""L_max per offload mode (resident / weights offloaded / + K and V streamed) with the predicted
transfer-to-compute ratio at each mode's L_max: what `mosaic plan --budget B --offload all`
prints. CPU only (meta tensors), like capacity.py."""

from __future__ import annotations

from ..config import EngineConfig
from ..errors import gib
from .capacity import capacity_report
from .offload import MODES, PCIE_BYTES_PER_S, offload_of, transfer_report


def capacity_modes(model, budget, modes=MODES, config: EngineConfig | None = None,
                   pcie_bytes_per_s: float = PCIE_BYTES_PER_S, **kw) -> dict:
    """{mode: capacity_report(...) + 'transfer': transfer_report at L_max} for each mode.
    config supplies prefetch_layers and kv_block_rows (defaults otherwise); kw go to
    capacity_report (prompt_ratio, context_bytes, world, min_attention_rows, ...)."""
    config = config or EngineConfig()
    out = {}
    for mode in modes:
        rep = capacity_report(model, budget, offload=offload_of(mode, config, model.cfg), **kw)
        chunks = rep["steps"][0]["chunks"][0] if rep["steps"] else 1
        rep["transfer"] = transfer_report(model, max(rep["l_max"], 1), mode, chunks, pcie_bytes_per_s)
        out[mode] = rep
    return {"model": model.name, "budget_bytes": next(iter(out.values()))["budget_bytes"], "modes": out}


def print_modes(rep: dict) -> str:
    lines = [f"{rep['model']} at {gib(rep['budget_bytes'])}: L_max per offload mode",
             f"{'mode':<12} {'L_max':>12} {'weights on GPU':>15} {'floor B/token':>14} {'chunks a,f,l':>16} "
             f"{'host K/V':>10} {'PCIe/layer':>11} {'compute/layer':>14} {'transfer/compute':>17}"]
    for mode, r in rep["modes"].items():
        t = r["transfer"]
        st = r["steps"][0] if r["steps"] else {}
        lines.append(f"{mode:<12} {r['l_max']:>12,} {gib(r['weights_bytes']):>15} {r['floor_bytes_per_token']:>14,} "
                     f"{str(tuple(st.get('chunks', ()))):>16} {gib(st.get('host_bytes', 0)):>10} "
                     f"{t['transfer_ms_per_layer']:>9.1f}ms {t['compute_ms_per_layer']:>12.1f}ms "
                     f"{t['transfer_to_compute']:>17.3f}")
    lines.append(f"(PCIe {rep['modes'][next(iter(rep['modes']))]['transfer']['pcie_bytes_per_s'] / 1e9:.0f} GB/s "
                 "pinned host-to-device; compute at the dense bf16 rate; ratio < 1: copies hide behind compute)")
    return "\n".join(lines)
