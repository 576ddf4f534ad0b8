"""Admission and capacity of a block-diffusion request (LLaDA2.x): its largest step plus the
block K/V store, decided before anything is allocated.

The store (memory/kv_store.py) holds K and V of every layer and canvas column for the whole
request: 2 x layers x kv_dim x itemsize bytes per token (LLaDA2.0-mini in bf16: 40 KiB), charged
on the device for its hot layers and staging slots. The largest step is the request's first:
it runs every column up to the end of the first denoised block (the prompt, its left padding
and the block; or two blocks, a later step's most, when that is more), with one block of masked
rows per sequence. Tiers as policy/kv_tier.py: device (every layer), host (two staging slots),
auto (the most hot layers that fit). policy/admitter.py asks request_probe for every decision."""

from __future__ import annotations

import torch

from ..memory.accounting import INPUT_BYTES_PER_TOKEN
from ..memory.kv_store import StoreLayout
from ..models.block_cache import BlockCacheStep, block_step
from ..runtime.samplers import sampler_for
from ..runtime.samplers.constrained_reducer import ConstrainedReducer

META = torch.device("meta")


def step_rows(first_end: int, block: int, width: int) -> int:
    """Rows per sequence of a request's largest step: up to its first block's end, or two blocks."""
    return min(width, max(first_end, 2 * block))


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
                  hot: int | None = None, itemsize: int = 2, constrained: bool = False):
    """The largest step of a request of `batch` prompts of prompt_len tokens and gen_len new ones,
    charged its store with `hot` layers on the device (None: all): what `mosaic plan` asks."""
    bl = block or block_of(model, gen)
    width = -(-(prompt_len + gen_len) // bl) * bl
    first_end = (prompt_len // bl + 1) * bl
    layout = StoreLayout.of(model.cfg, batch, width, itemsize, hot)
    return block_probe(model, batch, step_rows(first_end, bl, width), width, bl, gen, layout.device_bytes,
                       constrained)
