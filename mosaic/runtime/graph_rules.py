"""What runtime/graphs.py asks before and about a capture: whether a step can be captured, what a
reducer's draws need, how many ops a step runs (a graph's executable grows with them) and what a
shape's static inputs take from PyTorch's allocator."""

from __future__ import annotations

import torch

from ..memory.caching import segment_bytes
from ..models.step import Step

# an executable's bytes per op of its step before any graph was measured (the engine's warm-up
# measures one): a 32-layer step runs ~400 ops of 1-10 kernels, ~10 KiB a kernel node (cccl#3768)
DEFAULT_BYTES_PER_OP = 64 * 2**10


def eligible(step: Step, prepared, can_draw: bool = True) -> str | None:
    """Why this step cannot be captured (None: it can). can_draw: the backend can replay draws."""
    if step.shard is not None:
        return "sequence parallel"
    if step.offload is not None:
        return "offload"
    if step.sparse is not None:
        return "block-sparse"
    if step.rows_uncond is not None:
        return "cfg"
    if getattr(step.reducer, "uniform", True) is False:
        return "stacked reducers of different row math"
    cache = step.cache
    if cache is not None and cache.store is not None and cache.store.layout.hot < cache.store.layout.num_layers:
        return "host-tier store"
    if cache is not None and not getattr(cache, "capturable", True):
        return "fill slice"      # models/fill_slices.py: reads a residual stream outside the plan
    if step.num_masked == 0:
        return "no rows"
    return draw_problem(step.reducer, prepared, can_draw)


def draw_problem(reducer, prepared, can_draw: bool = True) -> str | None:
    """Why a reducer's random draws cannot be replayed by a graph (None: they can, or none)."""
    if not reducer_draws(reducer):
        return None
    if not can_draw or not hasattr(reducer, "with_generator"):
        return "random draws"
    fused = bool(getattr(prepared, "fused", False))
    if prepared is not None and prepared.chunks.logits > 1 and reducer.draw_calls(1, 1, torch.float32, fused):
        return "random draws over several logits chunks"   # padded chunks would shift later chunks' offsets
    return reducer.capture_problem(fused)


def reducer_draws(reducer) -> bool:
    """Whether a reducer draws random numbers."""
    if reducer is None:
        return False
    if hasattr(reducer, "parts"):        # several requests' reducers stacked (engine/batching.py)
        return any(reducer_draws(p) for p in reducer.parts)
    if hasattr(reducer, "draws"):
        return bool(reducer.draws)
    g = getattr(reducer, "g", None)
    return bool(g is not None and g.temperature > 0)


def input_set_bytes(ids_shape, rows: int, extra_words: int = 0) -> int:
    """What one shape's static inputs (ids, positions [B, L'] and rows [M] int64, and a batched
    block step's index in `extra_words` 8-byte words: one tensor, static_inputs) add to PyTorch's
    reserved bytes at most: the segment they would open."""
    n = 1
    for s in ids_shape:
        n *= s
    return segment_bytes(8 * (2 * n + rows + extra_words))


def _words(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // 8)


def static_inputs(step: Step, cap: int) -> tuple[tuple, int, dict | None]:
    """(key, bytes, None) of a step's static input set (ids and positions [B, L'], rows [cap] and a
    batched block step's index tensors); make_static_inputs makes it. One tensor for all of them:
    the index's four small tensors alone opened four 2 MiB segments, which a request's graph
    charge (policy/graph_charge.py: one segment an input set) never held, so a stacked step never
    captured under a budget."""
    extra = {k: t for k, t in step_inputs(step).items() if k not in ("ids", "positions", "rows")}
    key = (tuple(step.ids.shape), cap, tuple((k, tuple(t.shape), t.dtype) for k, t in extra.items()))
    return key, input_set_bytes(tuple(step.ids.shape), cap, sum(_words(t) for t in extra.values())), extra


def make_static_inputs(step: Step, cap: int, extra: dict) -> dict:
    """The static input tensors of static_inputs: views into one int64 tensor on the step's device."""
    n = step.ids.numel()
    flat = torch.empty(2 * n + cap + sum(_words(t) for t in extra.values()), dtype=torch.int64,
                       device=step.ids.device)
    shape = step.ids.shape
    out = {"ids": flat[:n].view(shape), "positions": flat[n:2 * n].view(shape), "rows": flat[2 * n:2 * n + cap]}
    at = 2 * n + cap
    for name, t in extra.items():
        w = _words(t)
        out[name] = flat[at:at + w].view(torch.uint8)[:t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        out[name].copy_(t)
        at += w
    return out


def executed_ops(template) -> int:
    """Ops a step of this template runs: each recorded op times the iterations of the loops
    around it (layers, chunks); a graph's kernel nodes grow with it."""
    if template is None:
        return 0
    total = 0
    loops = list(getattr(template, "loops", {}).items())
    counts = getattr(template, "loop_counts", {})
    for i in range(template.num_ops):
        n = 1
        for name, (a, b) in loops:
            if a <= i < b:
                n *= counts.get(name, 1)
        total += n
    return total


def step_inputs(step: Step) -> dict[str, torch.Tensor]:
    """The tensors a captured step reads that change between its replays: the canvas ids, the
    positions, the masked rows and, for a batched block step, where its sequences lie in their
    K/V buffer (models/batched_attention.BatchIndex)."""
    out = {"ids": step.ids, "positions": step.positions, "rows": step.rows}
    if step.cache is not None and hasattr(step.cache, "graph_inputs"):
        out.update(step.cache.graph_inputs())
    return out


HOST_FLAGS = ("ok", "drew")   # a reducer's host-branch flags (published.sample_tokens_captured)


def host_flags(outs: dict) -> tuple[bool, bool]:
    """(ok, drew) of a replayed step's outputs, read in one transfer: ok False where the published
    code took a host branch the graph could not (rerun eagerly); drew False where it took the
    argmax without a draw (the step stands, the request's stream does not move). (True, True)
    for a reducer without them."""
    flags = [outs[k].all() for k in HOST_FLAGS if k in outs]
    if not flags:
        return True, True
    got = torch.stack(flags).tolist()
    return bool(got[0]), bool(got[1]) if len(got) > 1 else True
