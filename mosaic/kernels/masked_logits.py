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
    seed: int = 0                # the stream's key where no seed tensor is given (tests)


NUM_FIELDS = 8  # per row and split: m1, s, idx1, m2, t, g, lg, ig (fp32)
# batch-invariant mode: every chunk splits the vocabulary this many times, whatever its M (the
# default's count at every M <= 1,088, i.e. every late step), so a row's partial sums never move
INVARIANT_SPLITS = 16


def workspace_rows(m: int, invariant: bool = False) -> int:
    """Rows of split state for a chunk of m masked rows: S(m)*m over every m' <= m, where
    S = ceil(264 / ceil(m/64)) <= 16 gives S*m <= min(16m, 16896 + m); 16m in batch-invariant
    mode. Monotone in m, so a plan made for a chunk of m rows also holds the state of any smaller
    chunk."""
    return INVARIANT_SPLITS * m if invariant else min(16 * m, 16896 + m)


def extra_bytes(m: int, invariant: bool = False) -> int:
    """Bytes the split combination allocates outside the plan: its [S, M] and [M] temporaries
    (fp32 maxima, scales and sums, uint8 masks, int64 ids: ~60 B per state row, measured on
    an H200 at M = 525k as the overshoot of a 24 B/row charge)."""
    return 64 * workspace_rows(m, invariant)


def fused_reduce(x: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, spec: FusedSpec,
                 outs: dict[str, torch.Tensor], ws_flat: torch.Tensor, invariant: bool = False,
                 seed: torch.Tensor | None = None) -> None:
    """x [N, d] final-normed hidden; rows [m] int64 (also the Gumbel stream's position key);
    w [V, d]; outs {"x0": [m] int64, "conf": [m]}; ws_flat [>= workspace_rows(m, invariant), 8]
    fp32. invariant: INVARIANT_SPLITS splits, one fixed tile, splits combined in a fixed order.
    seed: [1] int64 on x's device, the Gumbel stream's key read by the kernel (None: spec.seed)."""
    from . import masked_logits_triton as T
    m = rows.shape[0]
    S = INVARIANT_SPLITS if invariant else T.num_splits(m)
    assert S * m <= ws_flat.shape[0], (S, m, ws_flat.shape)
    ws = ws_flat[: S * m].view(S, m, NUM_FIELDS)
    T.launch(x, rows, rows, w, ws, spec, fixed=invariant, seed=seed)
    T.combine(ws, spec, outs, fixed_order=invariant)
