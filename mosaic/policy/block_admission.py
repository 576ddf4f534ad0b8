"""Admission and capacity of a block-diffusion request (LLaDA2.x): its largest step plus the
block K/V store, decided before anything is allocated.

The store (memory/kv_store.py) holds K and V of every layer and canvas column for the whole
request: 2 x layers x kv_dim x itemsize bytes per token (LLaDA2.0-mini in bf16: 40 KiB), charged
on the device for its hot layers and staging slots. The largest step is the request's first:
it runs every column up to the end of the first denoised block (the prompt, its left padding
and the block; or two blocks, a later step's most, when that is more), with one block of masked
rows per sequence. Tiers as policy/kv_tier.py: device (every layer), host (two staging slots),
auto (the most hot layers that fit)."""

from __future__ import annotations

import torch

from ..errors import MemoryBudgetError
from ..memory.accounting import INPUT_BYTES_PER_TOKEN
from ..memory.kv_store import StoreLayout
from ..models.block_cache import BlockCacheStep, block_step
from ..runtime.samplers.block_diffusion import DEFAULT_BLOCK, BlockReducer
from .admission import Admission, admit, fit
from .kv_tier import check_host

META = torch.device("meta")


def step_rows(first_end: int, block: int, width: int) -> int:
    """Rows per sequence of a request's largest step: up to its first block's end, or two blocks."""
    return min(width, max(first_end, 2 * block))


def block_probe(model, batch: int, rows: int, width: int, block: int, gen, resident: int = 0):
    """A block step on meta tensors: `rows` columns of `batch` sequences of `width`, one block of
    masked rows each, charged `resident` bytes of store (and the per-token inputs of the canvas
    columns the step does not run: the budget charges those of its own rows)."""
    ids = torch.empty(batch, width, dtype=torch.long, device=META)
    resident += INPUT_BYTES_PER_TOKEN * batch * (width - rows)
    spec = BlockCacheStep(0, rows, block, width, None, resident)
    masked = torch.empty(batch * min(block, rows), dtype=torch.long, device=META)
    return block_step(ids, (0,) * batch, spec, rows=masked, reducer=BlockReducer(gen, None))


def request_probe(model, batch: int, prompt_len: int, gen_len: int, gen, block: int | None = None,
                  hot: int | None = None, itemsize: int = 2):
    """The largest step of a request of `batch` prompts of prompt_len tokens and gen_len new ones,
    charged its store with `hot` layers on the device (None: all): what `mosaic plan` asks."""
    bl = block or gen.block_length or DEFAULT_BLOCK
    width = -(-(prompt_len + gen_len) // bl) * bl
    first_end = (prompt_len // bl + 1) * bl
    layout = StoreLayout.of(model.cfg, batch, width, itemsize, hot)
    return block_probe(model, batch, step_rows(first_end, bl, width), width, bl, gen, layout.device_bytes)


def admit_blocks(preparer, budget, model, canvas, gen, tier: str = "device") -> tuple[Admission, StoreLayout]:
    """Admit a block-diffusion request on its canvas (runtime/block_canvas.py) and choose where
    its store lives, or raise MemoryBudgetError naming the longest canvas (tokens) that fits.
    The refusal's search keeps the request's generated length and scales its prompt."""
    B, W, bl = canvas.batch, canvas.width, canvas.block
    first_end = (min(canvas.first_block(b) for b in range(B)) + 1) * bl
    tail = W - first_end                                   # columns after the first block (kept)
    itemsize = model.dtype.itemsize
    layout_for = lambda n, hot: StoreLayout.of(model.cfg, B, n, itemsize, hot)  # noqa: E731

    def step_for(n, hot):
        n = max(bl, -(-n // bl) * bl)
        rows = step_rows(max(bl, n - tail), bl, n)
        return block_probe(model, B, rows, n, bl, gen, layout_for(n, hot).device_bytes)

    n_layers = model.cfg.num_layers
    if tier == "host":
        hot = 0
    elif tier == "device" or budget.budget_bytes is None:
        hot = n_layers
    else:
        def ok(h):
            try:
                fit(preparer, budget, step_for(W, h))
                return True
            except MemoryBudgetError:
                return False
        if ok(n_layers):
            hot = n_layers
        elif not ok(0):
            hot = 0   # not even the host tier fits: admit raises below, naming what would
        else:
            lo, hi = 0, n_layers - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
            hot = lo
    adm = admit(preparer, budget, lambda n, m: step_for(n, hot), W, B * bl, min_length=bl)
    layout = layout_for(W, hot)
    check_host(layout)
    return adm, layout
