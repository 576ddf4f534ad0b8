"""Mask-only logits reduced on the fly: the spec of the fused kernel and its dispatch.

The kernel itself lives in masked_logits_triton.py; its PyTorch oracle in masked_logits_ref.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FusedSpec:
    temperature: float = 0.0     # > 0: Gumbel-max on a counter-based stream (seed, row, token)
    want_prob: bool = True       # softmax probability of the chosen token
    want_margin: bool = False    # top-1 minus top-2 probability (Dream topk_margin)
    want_entropy: bool = False   # sum p log(p + 1e-10) (Dream entropy, larger is more confident)
    prob_rank: bool = False      # Dream: x0 = argmax of probabilities (same as of logits, ties low)
    seed: int = 0


# per-row running state of the kernel: max, sum, best id, best score, second max, entropy sums
STATE_BYTES_PER_ROW = 8 * 8


def extra_bytes(m: int) -> int:
    """Device bytes the fused path needs beyond its [M] outputs: per-row state of one chunk."""
    return m * STATE_BYTES_PER_ROW


def fused_reduce(x: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, spec: FusedSpec,
                 outs: dict[str, torch.Tensor], row_offset: int) -> None:
    from . import masked_logits_triton as T
    T.reduce(x, rows, w, spec, outs, row_offset)
