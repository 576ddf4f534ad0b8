"""Dense runs of a model over calibration canvases, measuring per layer and head what each
block-sparse candidate keeps (policy/sparse_recall.py): the statistics `mosaic calibrate`
chooses from.

The model runs its own step program (models/layers.py) in an eager context whose attention op
computes the dense attention as always and, from the same q (after RoPE) and K, the exact block
mass and every candidate's recall; nothing is stored but per-head sums. One canvas at a time
(B = 1, no padding, one attention chunk), so the op's call count gives the layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..graph.ctx import EagerCtx
from ..models.layers import step_program
from ..models.step import make_step
from .sparse_recall import DEFAULT_GRID, Candidate, attention_stats


class _RecallCtx(EagerCtx):
    """An eager context that measures every attention call's sparse recall."""

    def __init__(self, model, block, candidates, estimates, rows):
        super().__init__(model.device, model.dtype)
        self.num_layers = model.cfg.num_layers
        self.block, self.candidates, self.estimates, self.rows = block, candidates, estimates, rows
        self.calls = 0
        self.per_layer: list[dict] = []

    def attention(self, name, q, k, v):
        out = super().attention(name, q, k, v)
        self.per_layer.append(attention_stats(q, k, self.block, self.candidates, self.estimates, self.rows))
        self.calls += 1
        return out


@dataclass
class RecallTable:
    """Mean statistics over the calibration canvases. recall[(estimate, label)]: [L][Hq] mean
    kept attention mass over every query row; recall_masked: the same over the masked rows (the
    answer slots); entropy: [L][Hq] normalised block entropy; block: key rows per block;
    key_blocks: key blocks of the longest canvas (densities are given for it)."""
    block: int
    estimates: tuple[str, ...]
    candidates: tuple[Candidate, ...]
    recall: dict = field(default_factory=dict)
    recall_masked: dict = field(default_factory=dict)
    entropy: list = field(default_factory=list)
    canvases: int = 0
    key_blocks: int = 0

    def layer_recall(self, estimate: str, label: str, layer: int, per: str = "min") -> float:
        """A layer's recall for the chooser: the lower of the all-rows and masked-rows means,
        averaged over heads (per='mean') or the worst head (per='min')."""
        a = self.recall[(estimate, label)][layer]
        m = self.recall_masked[(estimate, label)][layer]
        vals = [min(x, y) for x, y in zip(a, m)] if m else list(a)
        return min(vals) if per == "min" else sum(vals) / len(vals)

    def as_dict(self) -> dict:
        """JSON-ready: {estimate: {label: {"recall": [L][H], "recall_masked": [L][H]}}, ...}."""
        out = {"block": self.block, "canvases": self.canvases, "key_blocks": self.key_blocks,
               "entropy": self.entropy, "recall": {}}
        for (est, label), v in self.recall.items():
            out["recall"].setdefault(est, {})[label] = {
                "all_rows": [[round(x, 5) for x in h] for h in v],
                "masked_rows": [None if h is None else [round(x, 5) for x in h]
                                for h in self.recall_masked[(est, label)]]}
        return out


def measure(model, canvases, block: int, candidates=DEFAULT_GRID, estimates=("minmax",),
            progress=None) -> RecallTable:
    """RecallTable of `model` over canvases (a list of [L_i] int64 id tensors, masked positions
    holding cfg.mask_id). block: the sparse block (power of two >= 16). progress(i) after each
    canvas (a tqdm update). Runs under torch.no_grad; O(L_i^2 * Hq) fp32 work per layer."""
    cfg = model.cfg
    L = cfg.num_layers
    sums: dict = {}
    msums: dict = {}
    ent = [[0.0] * cfg.num_heads for _ in range(L)]
    rows_total = [0] * L
    masked_total = [0] * L
    key_blocks = 0
    with torch.no_grad():
        for i, ids in enumerate(canvases):
            ids = ids.to(model.device).view(1, -1)
            masked = (ids[0] == cfg.mask_id).nonzero().view(-1)
            ctx = _RecallCtx(model, block, tuple(candidates), tuple(estimates), masked)
            step_program(ctx, model, make_step(cfg, ids, None, dtype=model.dtype))
            assert ctx.calls == L, f"expected one attention call per layer, got {ctx.calls}"
            key_blocks = max(key_blocks, -(-ids.shape[1] // block))
            for layer, st in enumerate(ctx.per_layer):
                rows_total[layer] += st["rows"]
                masked_total[layer] += st["masked_rows"]
                for h in range(cfg.num_heads):
                    ent[layer][h] += float(st["entropy"][h])
                for key, rec in st.items():
                    if not isinstance(key, tuple):
                        continue
                    s = sums.setdefault(key, [[0.0] * cfg.num_heads for _ in range(L)])
                    m = msums.setdefault(key, [[0.0] * cfg.num_heads for _ in range(L)])
                    for h in range(cfg.num_heads):
                        s[layer][h] += float(rec["all"][h])
                        m[layer][h] += float(rec["masked"][h])
            if progress is not None:
                progress(i)
    table = RecallTable(block, tuple(estimates), tuple(candidates), canvases=len(canvases), key_blocks=key_blocks)
    table.entropy = [[e / max(1, rows_total[layer]) for e in ent[layer]] for layer in range(L)]
    for key in sums:
        table.recall[key] = [[x / max(1, rows_total[layer]) for x in sums[key][layer]] for layer in range(L)]
        table.recall_masked[key] = [[x / masked_total[layer] for x in msums[key][layer]] if masked_total[layer]
                                    else None for layer in range(L)]
    return table


class _OneSparseCtx(EagerCtx):
    """An eager context whose dense layers of a sparse step run the dense attention op (SDPA),
    as the reference forward does, so the error measured is the one sparse layer's alone (and
    the CPU does not pay the sparse kernel's fp32 reference on every layer)."""

    def attention_sparse(self, name, q, k, v, kpool, rng, block, k_total, q_block0, per_row=False):
        if rng is None:
            return self.attention(name, q, k, v)
        return super().attention_sparse(name, q, k, v, kpool, rng, block, k_total, q_block0, per_row)


def _masked_logprobs(model, ids: torch.Tensor, sparse) -> torch.Tensor:
    ids = ids.to(model.device).view(1, -1)
    step = make_step(model.cfg, ids, None, dtype=model.dtype, sparse=sparse)
    logits = step_program(_OneSparseCtx(model.device, model.dtype), model, step)     # [L, V]
    return torch.log_softmax(logits[ids[0] == model.cfg.mask_id].float(), dim=-1)   # [M, V]


def one_layer_error(model, canvases, sparse_for_layer, reference=None) -> tuple[dict, list]:
    """The end-to-end error of one sparse layer: {"kl": mean KL(p_dense || p_sparse) over the
    masked positions of every canvas (nats), "agree": the share of masked positions whose
    most likely token is unchanged}, and the dense log-probabilities (pass them back as
    `reference` to skip the dense forwards). sparse_for_layer: a config.SparseConfig with the
    one layer's range (dense_steps 0). One forward per canvas (plus one dense when no
    reference)."""
    kl, agree, n = 0.0, 0.0, 0
    with torch.no_grad():
        if reference is None:
            reference = [_masked_logprobs(model, ids, None) for ids in canvases]
        for ids, ref in zip(canvases, reference):
            lp = _masked_logprobs(model, ids, sparse_for_layer)
            kl += float((ref.exp() * (ref - lp)).sum(-1).sum())
            agree += float((ref.argmax(-1) == lp.argmax(-1)).sum())
            n += ref.shape[0]
    return {"kl": kl / max(1, n), "agree": agree / max(1, n)}, reference
