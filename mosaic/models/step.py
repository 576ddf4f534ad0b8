"""The inputs of one denoising step, built complete and never changed afterwards."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..errors import InputError
from ..graph.shard import Shard
from ..graph.streams import Offload
from ..kernels.host_ints import ints_on
from .families import family_of


class Chunks(NamedTuple):  # a tuple, so that torch.compile traces the step program unbroken
    """Chunk counts of the three phases that can be split (attention query rows, FFN/MoE rows,
    masked logits rows)."""
    attn: int = 1
    ffn: int = 1
    logits: int = 1

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.attn, self.ffn, self.logits)


@dataclass(frozen=True)
class Step:
    """One denoising step's inputs (small index tensors on the device, or meta tensors when only
    planning). Change a field with `step.with_(...)`, which returns a new Step."""
    ids: torch.Tensor                        # [B, L] int64
    positions: torch.Tensor                  # [B, L] int64
    pads: tuple[int, ...] | None = None      # left-padding per row: those keys are never attended
    zero_pad_rows: bool = False              # Dream: padded query rows attend to nothing either
    rows: torch.Tensor | None = None         # [M] int64 row of the hidden state per masked slot
    rows_uncond: torch.Tensor | None = None  # [M] the same slots in the cfg (unconditional) half
    reducer: object | None = None            # None: full logits for every position (native)
    chunks: Chunks = Chunks()
    shard: Shard | None = None               # this rank's positions under sequence parallelism
    sparse: object | None = None             # config.SparseConfig: block-sparse attention this step
    cache: object | None = None              # a models.kv_cache.CacheStep: block-cache fill or block step
    masked_total: int | None = None          # sharded: masked slots over all ranks (chunk choice)
    offload: Offload | None = None           # weights (and K/V) streamed from host memory this step

    @property
    def batch(self) -> int:
        return int(self.ids.shape[0])

    @property
    def length(self) -> int:
        return int(self.ids.shape[1])

    @property
    def num_masked(self) -> int:
        return 0 if self.rows is None else int(self.rows.shape[0])

    @property
    def shard_slots(self) -> int:
        """Sharded: the masked slots over all ranks, whose results every rank gathers; else 0."""
        return 0 if self.shard is None else (self.masked_total or self.num_masked)

    def with_(self, **changes) -> Step:
        return dataclasses.replace(self, **changes)


def make_step(cfg, ids: torch.Tensor, valid: torch.Tensor | None, dtype: torch.dtype | None = None,
              row_pads: tuple[int, ...] | None = None, **fields) -> Step:
    """Positions and masks as each family's reference builds them for (left-)padded batches
    (LLaDA-MoE as LLaDA: see below).

    ids [B, L] int64; valid [B, L] bool (False at left padding) or None; dtype: the model's
    (bfloat16 / float16 LLaDA rows are numbered from their first real token, below); row_pads:
    each row's left padding where the caller knows it on the host (valid was built from it), so
    that valid is not read back (a stacked step: engine/batching.py). Raises InputError when the
    padding is not on the left."""
    B, L = ids.shape
    padded = valid is not None and (any(row_pads) if row_pads is not None else not bool(valid.all()))
    pos = torch.arange(L, device=ids.device).expand(B, L)
    if not padded:
        return Step(ids, pos, **fields)
    if row_pads is not None:
        pads = tuple(row_pads)
    else:
        pads = tuple(int(p) for p in (~valid).sum(1).tolist())
        if not all(bool(valid[i, p:].all()) for i, p in enumerate(pads)):
            raise InputError("attention_mask must mark padding on the left only (zeros, then ones)")
    if family_of(cfg).padding == "rows":  # Dream: pad rows and columns masked; positions count real tokens only
        pos = (valid.long().cumsum(-1) - 1).masked_fill(~valid, 1)
        return Step(ids, pos, pads=pads, zero_pad_rows=True, **fields)
    # LLaDA: pads are masked as keys only. The published code numbers positions counting the
    # pads (kept in float32, where the published code is the oracle). RoPE is relative, so
    # numbering from the row's first real token is the same math, and it is the numbering the row
    # has alone: in bfloat16 / float16 its q and k then round exactly as alone (the published
    # numbering changed 1-3 of 20 LLaDA-MoE rows with their batch-mates; docs/MODELS.md).
    # LLaDA-MoE's published code ignores the attention mask, so there a prompt's answer depends
    # on its batch-mates; Mosaic masks its padded keys as LLaDA's do
    if dtype in (torch.bfloat16, torch.float16):
        pos = (pos - ints_on(pads, ids.device)[:, None]).clamp_(min=0)
    return Step(ids, pos, pads=pads, **fields)
