"""Tie-breaking that does not depend on left padding.

The published samplers commit the top-k confidences with torch.topk over each row of the whole
canvas [B, L]. Among equal confidences (frequent in bfloat16 / float16, where many positions
round to a probability of exactly 1.0) torch.topk's choice depends on the layout of the vector
it is given, so in a left-padded batch the pads in front of a row shift which tied position
wins: tiny-dream in bfloat16 gave `1688` for "8+8=" beside "123+456=" and `1668` alone.

In bfloat16 and float16 every row is ranked on the vector that starts at its first real token,
which is exactly the vector the row has alone (same length, same values: the CPU forward is
batch-invariant in these dtypes once positions are numbered from the row's first token too,
models/step.py), so the choice is the row's own. A row without padding (start 0) is ranked on
the full row as the published code does, so a batch of one or a batch without padding gives the
published tokens bit for bit in every dtype. In float32 (and float64) padded rows are ranked as
published, on the full row: there the published samplers are the oracle, ties are rare, and
the forward is not bit-for-bit batch-invariant anyway (~5e-7 between alone and padded).
Positions before a row's start are padding: never candidates (confidence -inf), so slicing them
off never changes which values are selected, only which of equal values is."""

from __future__ import annotations

import torch

# the dtypes in which a padded row is ranked (and positioned) from its first real token
FROM_ROW_START = (torch.bfloat16, torch.float16)


def from_row_start(dtype: torch.dtype | None) -> bool:
    """Whether a model of this dtype ranks ties and numbers positions from each row's first real
    token (bfloat16, float16) rather than as the published code does (float32, float64)."""
    return dtype in FROM_ROW_START


def row_starts(valid: torch.Tensor | None, dtype: torch.dtype | None = torch.bfloat16) -> list[int] | None:
    """Per row of a left-padded canvas, the index of its first real token (its count of pads);
    None when no row is padded or the model's dtype ranks as published (from_row_start).
    valid [B, L] bool (False = padding) or None."""
    if valid is None or not from_row_start(dtype):
        return None
    starts = (~valid.bool()).sum(1).tolist()
    return starts if any(starts) else None


def within(starts: list[int] | None, a: int) -> list[int] | None:
    """The starts relative to a canvas range beginning at column a (0 where it lies inside the
    prompt or after it)."""
    if starts is None:
        return None
    out = [max(s - a, 0) for s in starts]
    return out if any(out) else None


def topk(conf: torch.Tensor, k: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(conf, k) along the last dim, ranked on conf[..., start:] (indices into conf)."""
    if start == 0:
        return torch.topk(conf, k)
    values, idx = torch.topk(conf[..., start:], k)
    return values, idx + start


def topk_batch(conf: torch.Tensor, k: int, starts: list[int] | None) -> torch.Tensor:
    """[B, k] indices of each row's k highest confidences of conf [B, L]: one torch.topk call on
    the whole batch when no row is padded (the published call), else each row alone as a [1, L']
    call from its start (the call the row makes alone)."""
    if starts is None:
        return torch.topk(conf, k).indices
    return torch.cat([topk(conf[j:j + 1], k, s)[1] for j, s in enumerate(starts)])
