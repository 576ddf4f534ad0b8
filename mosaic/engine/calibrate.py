"""`mosaic calibrate`: the block-sparse attention per layer that is fastest at a stated quality.

    calibrate(model, out="engine.yaml", tasks=("kv", "niah", "copy"), lengths=(4096,), n=8)
    calibrate(model, out=..., prompts="prompts.jsonl", min_recall=0.95)

1. Calibration canvases: generated long-context tasks (mosaic/assets/long_tasks.py, seeded apart
   from the held-out set; the answer slots masked) for a model trained on them, or the prompts
   of a file with `answer_len` masked slots.
2. A dense run over them measures, per layer and head, every candidate's attention-mass recall
   and the block entropy (policy/sparse_measure.py, sparse_recall.py).
3. Per layer the cheapest candidate meeting the target (policy/sparse_choice.py): recall >=
   min_recall, or a one-layer output error (KL of the masked positions' distribution) <= max_kl.
4. With the task oracle: held-out accuracy (long_tasks.evaluate) dense and calibrated; with
   max_loss, the sparse layers are made dense one at a time, the largest one-layer error first
   (a step that does not lower the loss is undone: sparse_choice.back_off), until every (task,
   length) cell is within max_loss points of dense.
5. The engine YAML: `sparse:` the choice, `calibration:` how it was chosen (config_file.py
   accepts and ignores that record), and the modelled speed-ups (policy/sparse_cost.py) on the
   calibration geometry and on the llada-8b preset at 128k with the per-layer choices scaled by
   relative depth (layer i of 32 takes the choice of layer floor(i * L0 / 32)).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from tqdm.auto import tqdm

from ..assets import long_tasks as T
from ..config import SparseConfig
from ..errors import InputError
from ..policy import sparse_choice as SC
from ..policy.sparse_cost import Geometry, scale_choices
from ..policy.sparse_measure import measure
from ..policy.sparse_recall import DEFAULT_GRID
from .calibrate_verify import UNIFORM, Verification
from .engine import MosaicEngine

CALIBRATION_SEED = 31337         # the held-out prompts use long_tasks.HELD_OUT_SEED
ESTIMATES = ("minmax", "rows")
KL_CANVASES = 6                  # canvases of the one-layer error (one forward each per candidate)


def check_target(min_recall: float, max_loss: float | None, max_kl: float) -> None:
    if isinstance(min_recall, bool) or not isinstance(min_recall, (int, float)) or not 0 < min_recall <= 1:
        raise InputError(f"min_recall={min_recall!r} must be in (0, 1] (the share of attention mass kept)")
    if max_loss is not None and (isinstance(max_loss, bool) or not isinstance(max_loss, (int, float))
                                 or not 0 <= max_loss < 100):
        raise InputError(f"max_loss={max_loss!r} must be in [0, 100) accuracy points")
    if isinstance(max_kl, bool) or not isinstance(max_kl, (int, float)) or not 0 <= max_kl < math.inf:
        raise InputError(f"max_kl={max_kl!r} must be >= 0 nats (0: recall alone decides)")


def is_task_model(model) -> bool:
    """Does the model's tokenizer write long_tasks' words as their task ids (tiny-long, or a
    model trained by tools/train_long.py)?"""
    tok = getattr(model, "tokenizer", None)
    if tok is None or model.cfg.vocab < len(T.WORDS):
        return False
    probe = np.array([T.QUERY, T.K0 + 3, T.V0 + 5, T.W0 + 7, T.MARK])
    try:
        ids = tok.encode(T.text(probe))
    except Exception:  # noqa: BLE001 (any tokenizer failure: not the task vocabulary)
        return False
    return list(ids[-len(probe):]) == probe.tolist() and model.cfg.mask_id == T.MASK


def task_canvases(model, tasks, lengths, n: int, seed: int = CALIBRATION_SEED) -> list[torch.Tensor]:
    """n canvases per (task, length): BOS, prompt, ANSWER_LEN masked slots.

    Every answer slot masked: low-confidence remasking reveals the end-of-text slots first, so
    the answer's words are predicted while they are all still masked. (A first version revealed
    a random share of the slots: the masked positions were then mostly end-of-text, the one-layer
    KL of tiny-long's layer 1 at topk 0.2 read 0.0 instead of 1.77 on fully masked canvases, and
    the end-to-end check had to back that layer off: bench/results/calibration/*_revealed.*)."""
    out = []
    for length in lengths:
        for task in tasks:
            rng = np.random.default_rng([seed, T.TASKS.index(task), length])
            for _ in range(n):
                e = T.sample(rng, task, length)
                ans = np.full(T.ANSWER_LEN, model.cfg.mask_id)
                out.append(torch.tensor(np.concatenate([[T.BOS], e.ids, ans]), dtype=torch.long))
    return out


def read_prompts(path) -> list[str]:
    """Prompts of a file: .jsonl, one JSON string or object with "prompt" (or "text") a line;
    anything else, one prompt a line. Raises InputError for a missing, empty or bad file."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"prompts file {str(p)!r} does not exist")
    try:
        lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"prompts file {p}: cannot read it ({e})") from None
    if p.suffix.lower() != ".jsonl":
        prompts = lines
    else:
        prompts = []
        for i, ln in enumerate(lines, 1):
            try:
                v = json.loads(ln)
            except json.JSONDecodeError as e:
                raise InputError(f"prompts file {p} line {i}: not JSON ({e.msg})") from None
            v = v.get("prompt", v.get("text")) if isinstance(v, dict) else v
            if not isinstance(v, str):
                raise InputError(f"prompts file {p} line {i}: give a string or an object with a \"prompt\" string")
            prompts.append(v)
    if not prompts:
        raise InputError(f"prompts file {p} holds no prompt")
    return prompts


def prompt_canvases(model, prompts, answer_len: int) -> list[torch.Tensor]:
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise InputError(f"{model.name} has no tokenizer: calibration prompts are text")
    return [torch.tensor(list(tok.encode(p)) + [model.cfg.mask_id] * answer_len, dtype=torch.long) for p in prompts]


def calibrate(model, out=None, *, prompts=None, tasks=None, lengths=(4096,), n: int = 8,
              min_recall: float = 0.95, max_loss: float | None = None, max_kl: float = 0.01,
              block: int | None = None, dense_steps: int = 1, estimates=ESTIMATES, candidates=DEFAULT_GRID,
              verify: bool | None = None, eval_n: int | None = None, compare_uniform: bool = True,
              answer_len: int = 32, threads: int | None = None, device: str = "cpu", progress: bool = True,
              json_out=None) -> dict:
    """Choose block-sparse attention per layer for `model` (a bundled name, folder or loaded
    Model) and write the engine YAML to `out` (None: write nothing). Returns the record
    {"sparse": SparseConfig | None, "calibration": {...}} the YAML holds.

    prompts: a prompts file (read_prompts) or list of texts; else tasks (default kv, niah,
    copy for a task model) at `lengths` with n canvases each. min_recall in (0, 1]; max_kl >= 0
    (0: recall alone); max_loss (points, tasks only): verify end to end and back off. block:
    the sparse block (default 128 at >= 8k tokens, else 64). verify (default: with tasks):
    measure held-out accuracy dense / calibrated (eval_n prompts per cell, default n).
    Raises InputError for a bad target, file, task, length or a model the tasks do not fit."""
    check_target(min_recall, max_loss, max_kl)
    _check_out(out)
    texts = _texts(prompts, tasks, max_loss)      # a bad file fails before the model loads
    if threads is not None:
        torch.set_num_threads(int(threads))
    t0 = time.perf_counter()
    m = MosaicEngine(model, {"device": device, "progress": False}).model
    lengths = tuple(int(x) for x in lengths)
    if texts is None:
        tasks = _check_tasks(m, tasks, lengths, n)
        canvases = task_canvases(m, tasks, lengths, n)
        source = {"tasks": list(tasks), "lengths": list(lengths), "n": n, "seed": CALIBRATION_SEED}
    else:
        canvases = prompt_canvases(m, texts, answer_len)
        source = {"prompts": str(prompts) if isinstance(prompts, (str, Path)) else len(texts),
                  "answer_len": answer_len}
    longest = max(c.numel() for c in canvases)
    block = _check_block(m, longest, block, estimates[0])
    bar = tqdm(total=len(canvases), desc="calibrate: dense runs", disable=not progress, unit="canvas")
    table = measure(m, canvases, block, candidates, estimates, progress=lambda i: bar.update(1))
    bar.close()
    g = Geometry.of(m.cfg, longest, longest // 2)
    kl_set = canvases[:: max(1, len(canvases) // KL_CANVASES)][:KL_CANVASES]
    estimate, layers = _choose(m, table, g, block, estimates, min_recall, max_kl, kl_set, progress)
    choices = [c.candidate for c in layers]
    rec = {"target": {"min_recall": min_recall, "max_kl": max_kl, "max_loss": max_loss},
           "model": m.name, **source, "canvases": len(canvases), "block": block, "estimate": estimate,
           "candidates": [c.label for c in candidates],
           "recall_rule": "per layer: the lower of the all-rows and masked-rows mean recall, averaged over heads"}
    if max_loss is not None or (texts is None if verify is None else verify):
        check = Verification(m, tasks, lengths, eval_n or n, block, estimate, dense_steps, kl_set, progress)
        choices = check.run(choices, layers, max_loss, compare_uniform, rec)
    cfg = SC.to_sparse_config(choices, block, estimate, dense_steps)
    rec["layers"] = [c.as_dict(table.key_blocks) for c in layers]
    for d, c in zip(rec["layers"], choices):
        if c is None and d["pattern"] != "dense":     # backed off after the accuracy check
            d.update(backed_off_from=d["label"], pattern="dense", label="dense", keep=1.0, density=1.0)
    rec["modelled_speedup"] = _speedups(choices, g, block, estimate)
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    doc = {"sparse": cfg, "calibration": rec}
    if out is not None:
        write_yaml(out, doc)
    if json_out is not None:
        Path(json_out).write_text(json.dumps({"sparse": _plain(cfg), "calibration": rec,
                                              "recall_table": table.as_dict()}, indent=1) + "\n")
    return doc


def _check_out(out) -> None:
    if out is None:
        return
    o = Path(out)
    if o.suffix.lower() not in (".yaml", ".yml"):
        raise InputError(f"out {str(o)!r}: the engine config is a YAML file (.yaml or .yml)")
    if not o.parent.is_dir():
        raise InputError(f"out {str(o)!r}: the folder {str(o.parent)!r} does not exist")


def _texts(prompts, tasks, max_loss) -> list[str] | None:
    """The calibration prompts' texts (None: the tasks calibrate)."""
    if prompts is None:
        return None
    if tasks is not None:
        raise InputError("give calibration prompts or tasks, not both")
    if max_loss is not None:
        raise InputError("max_loss is measured on the long-context tasks: give tasks, or use min_recall")
    return read_prompts(prompts) if isinstance(prompts, (str, Path)) else list(prompts)


def _check_tasks(m, tasks, lengths, n: int) -> tuple:
    tasks = tuple(tasks or T.TASKS)
    bad = [t for t in tasks if t not in T.TASKS]
    if bad:
        raise InputError(f"unknown task {bad[0]!r}; tasks: {', '.join(T.TASKS)}")
    if not is_task_model(m):
        raise InputError(f"{m.name} was not trained on the long-context tasks (its vocabulary is not "
                         "long_tasks'): give calibration prompts (--prompts FILE)")
    if not lengths or min(lengths) < T.MIN_LENGTH:
        raise InputError(f"lengths {list(lengths)}: each at least {T.MIN_LENGTH} tokens")
    if n < 1:
        raise InputError(f"n={n}: give at least 1 canvas per task and length")
    return tasks


def _check_block(m, longest: int, block: int | None, estimate: str) -> int:
    if longest > m.cfg.max_seq_len:
        raise InputError(f"calibration canvases of {longest} tokens are longer than {m.name}'s trained length "
                         f"{m.cfg.max_seq_len}: the model has no context that long")
    block = block or (128 if longest >= 8192 else 64)
    if -(-longest // block) < 8:
        raise InputError(f"canvases of {longest} tokens make {-(-longest // block)} key blocks of {block}: "
                         "sparse attention needs longer contexts (>= 8 blocks)")
    SparseConfig(block=block, estimate=estimate)          # the block and estimate's own checks
    return block


def _choose(m, table, g, block: int, estimates, min_recall, max_kl, kl_set, progress):
    """(estimate, per-layer choices): the estimate whose choice models the fastest step."""
    bar = tqdm(desc="calibrate: one-layer errors", disable=not progress, unit="test")
    per_est, cache = {}, {}
    for est in estimates:
        layers = SC.choose_layers(table, g, est, min_recall, max_kl, m, kl_set,
                                  progress=lambda s: (bar.set_postfix_str(s), bar.update(1)), cache=cache)
        per_est[est] = (SC.modelled([c.candidate for c in layers], g, block, est)["ms"], layers)
    bar.close()
    estimate = min(per_est, key=lambda e: (per_est[e][0], estimates.index(e)))
    return estimate, per_est[estimate][1]


def _speedups(choices, g: Geometry, block: int, estimate: str) -> dict:
    """Modelled (H200 rates scaled by FLOPs, policy/sparse_cost.py) speed-ups of the choice."""
    big = Geometry.llada_8b()
    scaled = scale_choices(choices, big.layers)
    return {"label": "modelled: H200 kernel rates (bench/results/gpu/bench_attention.json, bench_sparse.json) "
                     "scaled by FLOPs; not a timing",
            "calibration_geometry": SC.modelled(choices, g, block, estimate),
            "llada_8b_128k": {**SC.modelled(scaled, big, 128, estimate),
                              "rule": f"layer i of {big.layers} takes the choice of layer floor(i * {len(choices)} "
                                      f"/ {big.layers})"},
            "llada_8b_128k_every_layer_topk_0.1": SC.modelled([UNIFORM] * big.layers, big, 128, estimate)}


def _plain(cfg: SparseConfig | None):
    if cfg is None:
        return None
    return {"block": cfg.block, "dense_steps": cfg.dense_steps, "estimate": cfg.estimate,
            "ranges": [{"layers": list(r.layers), "pattern": r.pattern, "keep": r.keep, "window": r.window,
                        "global_blocks": r.global_blocks} for r in cfg.ranges]}


def write_yaml(path, doc: dict) -> None:
    """The engine YAML of a calibration record ({"sparse", "calibration"})."""
    body = {"sparse": _plain(doc["sparse"]), "calibration": doc["calibration"]}
    head = ("# written by mosaic calibrate: the sparse section is the choice; calibration records how it\n"
            "# was chosen (the engine ignores it; docs/CONFIG.md \"Choosing sparsity with mosaic calibrate\")\n")
    Path(path).write_text(head + yaml.safe_dump(body, sort_keys=False, default_flow_style=None, width=110))
