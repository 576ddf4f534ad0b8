"""Admission and capacity of a block-diffusion request (LLaDA2.x): its largest step plus the
block K/V store, decided before anything is allocated.

The store (memory/kv_store.py) holds K and V of every layer and canvas column for the whole
request: 2 x layers x kv_dim x itemsize bytes per token (LLaDA2.0-mini in bf16: 40 KiB), charged
on the device for its hot layers and staging slots. Admission checks every shape of step the
request runs, each with one block of masked rows per sequence: its first (every column up to the
end of the first denoised block: the prompt, its left padding and the block), a later block's
first (two blocks: the one finished since and the new one) and a step inside a block (one
block). The smaller steps must fit on their own: their chunking differs (a one-block step's
attention cannot split), and a sampled request's logits transient adds to whatever peak they
have. Tiers as policy/kv_tier.py: device (every layer), host (two staging slots), auto (the most
hot layers that fit). policy/admitter.py asks request_probe for every decision."""

from __future__ import annotations

import torch

from ..memory.accounting import INPUT_BYTES_PER_TOKEN
from ..memory.kv_store import StoreLayout
from ..models.block_cache import BlockCacheStep, block_step
from ..runtime.samplers import sampler_for
from ..runtime.samplers.constrained_reducer import ConstrainedReducer

META = torch.device("meta")


def step_rows(first_end: int, block: int, width: int, steps: int = 1) -> list[int]:
    """Rows per sequence of each kind of step a request runs, largest first: its first step (up
    to its first block's end), a later block's first step (two blocks) and, with more than one
    step per block, a step inside a block (one block)."""
    rows = {min(width, first_end)}
    if width > first_end:
        rows.add(min(width, 2 * block))
    if steps > 1:
        rows.add(min(width, block))
    return sorted(rows, reverse=True)


def block_probe(model, batch: int, rows: int, width: int, block: int, gen, resident: int = 0,
                constrained: bool = False):
    """A block step on meta tensors: `rows` columns of `batch` sequences of `width`, one block of
    masked rows each, charged `resident` bytes of store (and the per-token inputs of the canvas
    columns the step does not run: the budget charges those of its own rows); constrained: its
    reducer as an output constraint runs it (runtime/samplers/constrained_reducer.py)."""
    ids = torch.empty(batch, width, dtype=torch.long, device=META)
    resident += INPUT_BYTES_PER_TOKEN * batch * (width - rows)
    spec = BlockCacheStep(0, rows, block, width, None, resident)
    masked = torch.empty(batch * min(block, rows), dtype=torch.long, device=META)
    reducer = sampler_for(model.cfg, gen).block_reducer(gen)
    if constrained:
        reducer = ConstrainedReducer(reducer, None, masked, rows, model.cfg.vocab)
    return block_step(ids, (0,) * batch, spec, rows=masked, reducer=reducer)


def block_of(model, gen) -> int:
    """The request's block length (its family's published default when unset)."""
    return sampler_for(model.cfg, gen).block(gen)


def request_probe(model, batch: int, prompt_len: int, gen_len: int, gen, block: int | None = None,
                  hot: int | None = None, itemsize: int = 2, constrained: bool = False, extra_bytes: int = 0):
    """(the largest step, variants) of a request of `batch` prompts of prompt_len tokens and
    gen_len new ones, charged its store with `hot` layers on the device (None: all): variants
    are functions step -> step giving its other kinds of step (policy/admission.fit checks each);
    constrained: an output constraint's reducer runs them; extra_bytes: device bytes held besides
    the store (the K/V pool's growth or idle buffers), charged like it. What admission and `mosaic plan` ask."""
    bl = block or block_of(model, gen)
    width = -(-(prompt_len + gen_len) // bl) * bl
    first_end = (prompt_len // bl + 1) * bl
    layout = StoreLayout.of(model.cfg, batch, width, itemsize, hot)
    steps = min(gen.steps or bl, max(gen_len, 1))
    probes = [block_probe(model, batch, r, width, bl, gen, layout.device_bytes + extra_bytes, constrained)
              for r in step_rows(first_end, bl, width, steps)]
    return probes[0], tuple((lambda _, st=st: st) for st in probes[1:])
