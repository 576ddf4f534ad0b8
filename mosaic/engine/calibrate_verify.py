"""`mosaic calibrate`'s end-to-end check (engine/calibrate.py step 4): held-out accuracy of the
long-context tasks dense, calibrated and with every layer at keep 0.1, and the back-off of
sparse layers until every (task, length) cell is within max_loss points of dense."""

from __future__ import annotations

from tqdm.auto import tqdm

from ..assets import long_tasks as T
from ..policy import sparse_choice as SC
from ..policy.sparse_measure import one_layer_error
from ..policy.sparse_recall import Candidate
from .engine import MosaicEngine

UNIFORM = Candidate("topk", 0.1)  # the every-layer keep 0.1 setting it is compared with


def accuracy(model, sparse, tasks, lengths, n: int) -> dict:
    """{"task@length": exact-match percent} of the held-out prompts with this sparse config."""
    engine = MosaicEngine(model, {"progress": False, "sparse": sparse})
    res = T.evaluate(engine, tasks, lengths, n)
    return {f"{c['task']}@{c['length']}": round(100 * c["exact"], 2) for c in res["cells"]}


def worst_loss(dense: dict, acc: dict) -> float:
    """The largest accuracy drop (points) of any cell against dense."""
    return max(dense[k] - acc[k] for k in dense)


class Verification:
    """The held-out check of one calibration: model, tasks, lengths, n prompts per cell, the
    sparse block / estimate / dense_steps, the canvases of the one-layer errors."""

    def __init__(self, model, tasks, lengths, n: int, block: int, estimate: str, dense_steps: int, kl_set,
                 progress: bool):
        self.m, self.tasks, self.lengths, self.n = model, tasks, lengths, n
        self.block, self.estimate, self.dense_steps, self.kl_set = block, estimate, dense_steps, kl_set
        self.progress = progress

    def config(self, choices):
        return SC.to_sparse_config(choices, self.block, self.estimate, self.dense_steps)

    def acc(self, choices) -> dict:
        return accuracy(self.m, self.config(choices), self.tasks, self.lengths, self.n)

    def run(self, choices, layers, max_loss, compare_uniform: bool, rec: dict):
        """Measure, back off (with max_loss), fill rec's accuracy / backoff / one_layer_kl; the
        per-layer choices that remain (None: dense)."""
        bar = tqdm(desc="calibrate: held-out accuracy", disable=not self.progress, unit="config")
        acc = {"dense": accuracy(self.m, None, self.tasks, self.lengths, self.n)}
        bar.update(1)
        acc["calibrated"] = self.acc(choices) if self.config(choices) else dict(acc["dense"])
        bar.update(1)
        backoff = []
        if max_loss is not None:
            choices, backoff, errs = self.back_off(choices, layers, acc, max_loss, bar)
            rec["one_layer_kl"] = {str(i): round(v, 5) for i, v in sorted(errs.items())}
        if compare_uniform:
            acc["every_layer_topk_0.1"] = self.acc([UNIFORM] * self.m.cfg.num_layers)
            bar.update(1)
        bar.close()
        rec["accuracy"] = {"n": self.n, "held_out_seed": T.HELD_OUT_SEED, "dense_steps": self.dense_steps,
                           "exact_percent": acc,
                           "worst_loss_points": round(worst_loss(acc["dense"], acc["calibrated"]), 2)}
        rec["backoff"] = backoff
        return choices

    def back_off(self, choices, layers, acc: dict, max_loss: float, bar):
        """Sparse layers made dense, the largest one-layer error first (sparse_choice.back_off),
        until the worst cell is within max_loss; acc["calibrated"] updated. (choices, steps, errors)."""
        errs = {c.layer: c.error["kl"] for c in layers if c.error is not None}
        if worst_loss(acc["dense"], acc["calibrated"]) <= max_loss:
            return choices, [], errs
        for i, c in enumerate(choices):
            if c is not None and i not in errs:
                errs[i] = one_layer_error(self.m, self.kl_set, SC.sparse_for(i, c, self.block, self.estimate))[0]["kl"]
        measured = {}

        def loss(trial):
            measured[tuple(map(str, trial))] = got = self.acc(trial)
            bar.update(1)
            return worst_loss(acc["dense"], got)

        order = sorted((i for i, c in enumerate(choices) if c is not None), key=lambda i: -errs[i])
        choices, steps = SC.back_off(choices, order, loss, worst_loss(acc["dense"], acc["calibrated"]), max_loss)
        acc["calibrated"] = measured.get(tuple(map(str, choices)), dict(acc["dense"])) if self.config(choices) \
            else dict(acc["dense"])
        return choices, steps, errs
