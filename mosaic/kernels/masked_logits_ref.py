"""PyTorch oracle of the fused masked-logits reduction (and what it computes, in plain ops)."""

from __future__ import annotations

import torch


def reduce_reference(x, rows, w, spec, uniform: torch.Tensor | None = None) -> dict:
    """x [N, d]; rows [m]; w [V, d]. uniform [m, V] is the Gumbel stream when temperature > 0."""
    logits = (x[rows] @ w.t()).float()                       # [m, V], rounded to the model dtype
    if spec.temperature > 0:
        x0 = torch.argmax(logits - spec.temperature * torch.log(-torch.log(uniform)), dim=-1)
    else:
        x0 = torch.argmax(logits, dim=-1)                    # ties: the lowest id
    p = torch.softmax(logits, dim=-1)
    out = {"x0": x0}
    if spec.want_margin:
        top = p.topk(2, dim=-1).values
        out["conf"] = top[:, 0] - top[:, 1]
    elif spec.want_entropy:
        out["conf"] = (p * torch.log(p + 1e-10)).sum(-1)
    else:
        out["conf"] = p.gather(-1, x0[:, None])[:, 0]
    return out
