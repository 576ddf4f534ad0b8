"""One MoE layer's routed experts timed by kernel (the families suite's `moe_kernels` part): the
per-expert loop, torch._grouped_mm and the Triton kernel (mosaic/kernels/moe*.py), eager and
captured as a CUDA graph, beside the floor of the experts the rows reach."""

from __future__ import annotations

import torch

from mosaic.kernels import moe as MK
from mosaic.kernels import reference as R

from .measure import cuda_ms, graph_ms

# name -> (experts, top-k, expert FFN width, hidden): the presets' MoE geometry
GEOMETRY = {"llada2-mini": (256, 8, 512, 2048), "llada-moe-7b": (64, 8, 1024, 2048)}


def _silu_mul(g, u):
    R.silu_mul_(g, u)


def _runner(kind: str, h, w, top_i, k: int):
    """fn() running the experts of one layer with kernel `kind` into a fixed slots buffer."""
    n, d = h.shape
    E, F = w[0].shape[0], w[0].shape[1]
    rows = n * k
    slots = torch.empty(rows, d, device=h.device, dtype=h.dtype)
    if kind == "loop":
        scratch = [torch.empty(n, c, device=h.device, dtype=h.dtype) for c in (d, F, F)]

        def fn():
            order, offs = MK.sort_by_expert(top_i, num_experts=E)
            MK.experts_loop(slots, h, order, offs, k, *w, *scratch, R.linear, _silu_mul)
    elif kind == "grouped":
        xs = torch.empty(rows, d, device=h.device, dtype=h.dtype)

        def fn():
            order, offs = MK.sort_by_expert(top_i, num_experts=E)
            MK.experts_grouped(slots, h, order, offs, k, *w, xs, _silu_mul)
    else:
        act = torch.empty(rows, F, device=h.device, dtype=h.dtype)
        table = torch.empty(3, MK.num_blocks(rows, E, MK.tiles(rows, E, h.dtype)[0]), device=h.device,
                            dtype=torch.int32)

        def fn():
            order, offs = MK.sort_by_expert(top_i, num_experts=E)
            MK.experts_triton(slots, h, order, offs, k, *w, act, table)
    return fn, slots


def layer(name: str, n: int, copy_bytes_per_s: float, kinds=("loop", "grouped", "triton")) -> dict:
    """One layer's experts of preset geometry `name` for n rows (bf16, random weights and routing)."""
    E, k, F, d = GEOMETRY[name]
    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(n)
    w = [(torch.randn(E, F, d, device="cuda", generator=g) * 0.02).to(bf),
         (torch.randn(E, F, d, device="cuda", generator=g) * 0.02).to(bf),
         (torch.randn(E, d, F, device="cuda", generator=g) * 0.02).to(bf)]
    h = torch.randn(n, d, device="cuda", generator=g).to(bf)
    top_i = torch.rand(n, E, device="cuda", generator=g).topk(k, dim=-1)[1]
    reached = int(torch.unique(top_i).numel())
    row = {"model": name, "rows": n, "experts_reached": reached,
           "floor_ms": reached * 3 * F * d * 2 / copy_bytes_per_s * 1e3}
    ref = None
    for kind in kinds:
        try:
            fn, slots = _runner(kind, h, w, top_i, k)
            fn()
            out = slots.float().clone()
            ref = out if ref is None else ref
            row[f"{kind}_rel_err"] = float((out - ref).norm() / ref.norm())
            row[f"{kind}_ms"] = cuda_ms(fn, 10)
            if kind != "loop":    # the loop reads its group sizes on the host: not capturable
                row[f"{kind}_graph_ms"] = graph_ms(fn)
                row[f"{kind}_x_floor"] = row[f"{kind}_graph_ms"] / row["floor_ms"]
        except Exception as e:  # noqa: BLE001  (recorded; the other kernels still run)
            row[f"{kind}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row
