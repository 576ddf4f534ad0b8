"""Choosing each layer's block-sparse pattern: the cheapest candidate meeting a quality target.

Per layer and block estimate, the candidates (policy/sparse_recall.DEFAULT_GRID) are tried from
the cheapest (modelled attention ms at the calibration geometry, policy/sparse_cost.py; ties:
topk before the distance-only patterns, whose fixed windows do not scale with the context, then
the larger keep) to the dearest; the first that passes is the layer's choice, dense when
none does. A candidate passes when
  recall >= min_recall      the layer's attention-mass recall (RecallTable.layer_recall: the
                            lower of the all-rows and masked-rows means, averaged over heads),
  or, when max_kl > 0, the candidate's one-layer output error (only that layer sparse, the
  final distribution at the masked positions, policy/sparse_measure.one_layer_error) has
  KL <= max_kl. Diffuse layers (block entropy near 1) keep little of their mass under any
  pattern, yet their output, an average of nearly exchangeable values, barely moves: recall
  alone would keep them dense (measured on tiny-long: layers 2-3 recall 0.13 at keep 0.1,
  KL 1e-4 nats).
The estimate (one per config: SparseConfig.estimate) is the one whose chosen layers give the
lowest modelled step time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import SparseConfig, SparseRange
from .sparse_cost import Geometry, candidate_cost, step_ms
from .sparse_measure import RecallTable, one_layer_error
from .sparse_recall import Candidate

PATTERN_ORDER = {"dense": 0, "topk": 1, "global_local": 2, "window": 3}


@dataclass
class LayerChoice:
    """One layer's choice: the candidate (dense: None), its recall and entropy, the one-layer
    error when measured, and the candidates tried with why each failed."""
    layer: int
    candidate: Candidate | None
    recall: float
    entropy: float
    error: dict | None = None
    tried: list = field(default_factory=list)

    def as_dict(self, key_blocks: int) -> dict:
        c = self.candidate
        return {"layer": self.layer, "pattern": "dense" if c is None else c.pattern,
                "label": "dense" if c is None else c.label, "keep": 1.0 if c is None else c.keep,
                "density": 1.0 if c is None else round(c.density(key_blocks), 4),
                "recall": round(self.recall, 4), "entropy": round(self.entropy, 4),
                **({"one_layer_kl": round(self.error["kl"], 5), "one_layer_agree": round(self.error["agree"], 4)}
                   if self.error else {}), "tried": self.tried}


def ordered(candidates, g: Geometry, block: int, estimate: str, recall_of) -> list[Candidate]:
    """Candidates cheapest first (ties: PATTERN_ORDER, then the larger keep, which transfers to
    longer contexts with more blocks, then the higher recall)."""
    return sorted(candidates, key=lambda c: (round(candidate_cost(c, g, block, estimate), 9), PATTERN_ORDER[c.pattern],
                                             -c.keep, -recall_of(c)))


def sparse_for(layer: int, c: Candidate, block: int, estimate: str) -> SparseConfig:
    return SparseConfig((c.range((layer, layer)),), block=block, dense_steps=0, estimate=estimate)


def choose_layers(table: RecallTable, g: Geometry, estimate: str, min_recall: float, max_kl: float = 0.0,
                  model=None, canvases=None, progress=None, cache=None) -> list[LayerChoice]:
    """Each layer's LayerChoice under one estimate (see the module docstring). model and
    canvases (a few calibration canvases) are needed when max_kl > 0; progress(text) when a
    one-layer error is measured; cache: a dict of one-layer errors shared between calls (the
    distance-only patterns do not depend on the estimate)."""
    cache = {} if cache is None else cache
    out, reference = [], cache.get("reference")
    for layer in range(len(table.entropy)):
        ent = sum(table.entropy[layer]) / len(table.entropy[layer])
        rec = lambda c, layer=layer: table.layer_recall(estimate, c.label, layer, "mean")  # noqa: E731
        choice = LayerChoice(layer, None, 1.0, ent)
        for c in ordered(table.candidates, g, table.block, estimate, rec):
            if c.pattern == "dense":
                break
            r = rec(c)
            if r >= min_recall:
                choice = LayerChoice(layer, c, r, ent, tried=choice.tried)
                break
            if max_kl > 0 and model is not None and canvases:
                if progress is not None:
                    progress(f"layer {layer} {c.label}")
                key = (layer, c.layout_key(table.key_blocks), estimate if c.pattern == "topk" else None)
                if key not in cache:
                    sp = sparse_for(layer, c, table.block, estimate)
                    cache[key], reference = one_layer_error(model, canvases, sp, reference)
                    cache["reference"] = reference
                err = cache[key]
                if err["kl"] <= max_kl:
                    choice = LayerChoice(layer, c, r, ent, err, tried=choice.tried)
                    break
                choice.tried.append({"label": c.label, "recall": round(r, 4), "one_layer_kl": round(err["kl"], 5)})
            else:
                choice.tried.append({"label": c.label, "recall": round(r, 4)})
        out.append(choice)
    return out


def to_sparse_config(choices, block: int, estimate: str, dense_steps: int = 1) -> SparseConfig | None:
    """The SparseConfig of per-layer choices (Candidate or None per layer): adjacent layers with
    the same candidate share a range; dense layers get none. None when every layer is dense."""
    ranges, start = [], 0
    for i in range(1, len(choices) + 1):
        if i == len(choices) or choices[i] != choices[start]:
            c = choices[start]
            if c is not None and c.pattern != "dense":
                ranges.append(c.range((start, i - 1)))
            start = i
    if not ranges:
        return None
    return SparseConfig(tuple(ranges), block=block, dense_steps=dense_steps, estimate=estimate)


def choices_of(config: SparseConfig | None, layers: int) -> list[Candidate | None]:
    """The per-layer candidates of a SparseConfig (None: dense)."""
    out: list[Candidate | None] = [None] * layers
    for r in (config.ranges if config else ()):
        for i in range(r.layers[0], min(layers - 1, r.layers[1]) + 1):
            out[i] = None if r.pattern == "dense" else Candidate(r.pattern, r.keep if r.pattern == "topk" else 1.0,
                                                                   r.window, r.global_blocks)
    return out


def modelled(choices, g: Geometry, block: int, estimate: str) -> dict:
    """step_ms of per-layer choices, rounded for a report."""
    r = step_ms(g, choices, block, estimate)
    return {"tokens": g.tokens, "layers": g.layers, "block": block, "estimate": estimate,
            "dense_ms": round(r["dense_ms"], 3), "ms": round(r["ms"], 3), "speedup": round(r["speedup"], 3),
            "density": [round(d, 4) for d in r["density"]]}


def describe(r: SparseRange) -> str:
    return f"layers {r.layers[0]}-{r.layers[1]} {r.pattern}" + (f" keep {r.keep:g}" if r.pattern == "topk" else "")


def back_off(choices, order, loss, loss_now: float, max_loss: float) -> tuple[list, list]:
    """Make sparse layers dense until loss(choices) <= max_loss: (final choices, steps).

    choices: a Candidate or None (dense) per layer; order: layer indices, the most lossy first
    (the largest one-layer error); loss(choices) -> points lost (an end-to-end measurement);
    loss_now: the loss of `choices`. Each step makes the first untried sparse layer of `order`
    dense and measures; a step that does not lower the loss is undone (the layer stays sparse and
    is not tried again until a later step lowers the loss), since a one-layer error measured on
    a few canvases can miss the layer that matters (tiny-long at 2k: layer 1's read 0.0). When
    every remaining layer was tried without gain, every layer becomes dense (loss 0)."""
    current, steps, tried = list(choices), [], set()
    while loss_now > max_loss:
        left = [i for i in order if current[i] is not None and i not in tried]
        if not left:
            steps.append({"all_dense": True, "loss_before": round(loss_now, 2)})
            return [None] * len(current), steps
        i = left[0]
        trial = [None if j == i else c for j, c in enumerate(current)]
        got = 0.0 if all(c is None for c in trial) else loss(trial)
        kept = got < loss_now
        steps.append({"layer": i, "was": current[i].label, "loss_before": round(loss_now, 2),
                      "loss_after": round(got, 2), "dense_now": kept})
        if kept:
            current, loss_now, tried = trial, got, set()
        else:
            tried.add(i)
    return current, steps
