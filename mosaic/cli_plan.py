"""`mosaic plan`: one step's plan at N tokens, or the longest request that fits a budget (per
offload mode, per GPU under several processes), planned on meta tensors for the device asked."""

from __future__ import annotations

import dataclasses
import json

import torch

from .config import PLANNER_CHOICES, EngineConfig
from .config_file import load_engine_config
from .engine import check_sparse_layers
from .errors import InputError, gib
from .graph.tensor import TensorShard
from .loader import load
from .models.precision import apply_precision, quantize_embedding, ranges
from .models.step import Chunks
from .policy.capacity import capacity_report, plan_report, print_capacity
from .policy.capacity_modes import capacity_modes, print_modes
from .policy.offload import MODES
from .policy.precision import plan_precision

PLANNED_FOR = {"cuda": "planned for cuda: charged as on an H200 (its measured CUDA context and workspace, bfloat16)",
               "cpu": "planned for cpu: charged as the engine charges on a CPU (float32, no CUDA context, no "
                      "allocator rounding); --device cuda gives the H200's figures"}


def _plan_capacity(args, econf, model, precision, device: str, tp: int) -> tuple[dict, str]:
    """mosaic plan --budget: the capacity report (resident, or per offload mode) and its text."""
    kw = dict(prompt_ratio=args.prompt_ratio, planner=args.planner or "greedy-size",
              context_bytes=args.context_bytes, world=1 if tp > 1 else args.gpus, kv_tier=args.kv_tier,
              min_attention_rows=args.min_attention_rows, target=device)
    offload = args.offload or (econf.offload if econf.offload not in ("off", "auto") else None)
    if offload is None:
        rep = capacity_report(model, args.budget, sparse=econf.sparse, **kw)
        text = print_capacity(rep)
        if econf.sparse is not None:   # lossy: labelled as generate labels it
            rep["lossy"] = ["sparse attention (block-sparse steps planned too)"]
            text += "\nlossy: sparse attention from --config (its block-sparse steps must fit too)"
    else:   # a block cache keeps its K/V in its own store: no streamed-K/V row beside it
        modes = tuple(m for m in (MODES if offload == "all" else (offload,))
                      if not (args.kv_tier and m == "weights+kv" and offload == "all"))
        rep = capacity_modes(model, args.budget, modes, econf, **kw)
        text = print_modes(rep)
    rep["device"] = device
    text = f"{PLANNED_FOR[device]}\n{text}"
    if tp > 1:   # every rank holds the same share: rank 0's plan is every rank's
        rep["tensor_parallel"] = tp
        text += f"\ntensor parallel over {tp} GPUs: per GPU, 1/{tp} of the heads and FFN columns (NCCL not charged)"
    if device == "cpu":
        text = text.replace("charged as on the GPU", "charged as on this CPU")
    if precision is not None:
        rep["precision"] = precision
        text += "\nprecision: " + ", ".join(f"layers {r['layers'][0]}-{r['layers'][1]} {r['dtype']}"
                                            for r in precision["ranges"]) + \
            f" · weights {gib(precision['weight_bytes'])} (16-bit: {gib(precision['weight_bytes_16bit'])})"
    return rep, text


def cmd_plan(args) -> int:
    if args.budget is None and args.tokens is None:
        raise InputError("mosaic plan needs --tokens N (one step's plan) or --budget SIZE (the longest that fits)")
    if args.masked is not None and args.tokens is not None and args.masked > args.tokens:
        raise InputError(f"--masked {args.masked} is more than --tokens {args.tokens}: masked tokens are part of N")
    econf = load_engine_config(args.config) if args.config else EngineConfig()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tp = args.gpus if args.parallel == "tensor" and args.gpus > 1 else 1   # tensor parallel: rank 0's shard
    if tp > 1 and (econf.precision is not None or econf.sparse is not None or args.offload):
        raise InputError("mosaic plan --parallel tensor plans resident 16-bit weights with dense attention: drop "
                         "--offload and the config's precision and sparse")
    model, precision = _plan_model(args.model, econf.precision, device, tp)
    check_sparse_layers(econf.sparse, model)
    if args.budget is not None:
        rep, text = _plan_capacity(args, econf, model, precision, device, tp)
        print(json.dumps(rep) if args.json else text)
        return 0
    planners = [args.planner] if args.planner else list(PLANNER_CHOICES)
    rep = plan_report(model, args.tokens, args.masked or max(1, args.tokens // 2), planners,
                      Chunks(*(args.chunks or (1, 1, 1))), target=device)
    rep["device"] = device
    first = rep["planners"][0]
    if args.json:
        print(json.dumps({**rep, "planner": first["planner"], "plan_bytes": first["plan_bytes"],
                          "load_bytes": first["load_bytes"], "plan_ms": first["plan_ms"]}))
        return 0
    print(f"{rep['model']}: N={rep['tokens']:,} M={rep['masked']:,} chunks={rep['chunks']} "
          f"buffers={rep['num_buffers']} ops={rep['num_ops']} peak op={rep['peak_op']} "
          f"outside the plan {gib(rep['external_bytes'])}")
    print(f"{'planner':<12} {'plan':>12} {'LOAD':>12} {'over LOAD':>10} {'ms':>9}")
    for r in rep["planners"]:
        print(f"{r['planner']:<12} {gib(r['plan_bytes']):>12} {gib(r['load_bytes']):>12} "
              f"{100 * r['over_load']:>9.2f}% {r['plan_ms']:>9.2f}")
    return 0


def _plan_model(name: str, pc, device: str = "cuda", tp: int = 1):
    """(model on meta tensors in the dtype the engine uses on `device`, its precision report or
    None): explicit precision ranges apply on meta tensors; a sensitivity choice (pc.auto) needs
    the weights, then drops them. tp > 1: rank 0's share under tensor parallelism over tp GPUs."""
    dtype = "bfloat16" if device == "cuda" else "float32"
    model = load(name, device="cpu" if pc is not None and pc.auto else "meta", dtype=dtype,
                 tensor=TensorShard(0, tp) if tp > 1 else None)
    if pc is None:
        return model, None
    precision = plan_precision(model, pc)
    apply_precision(model, precision["dtypes"])
    if pc.embed == "fp8":
        quantize_embedding(model)
    precision["ranges"] = ranges(model.precision)
    return (_as_meta(model) if model.device.type != "meta" else model), precision


def _as_meta(model):
    """The same model on meta tensors (capacity planning needs only shapes and dtypes)."""
    import torch
    meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")  # noqa: E731
    return dataclasses.replace(model, embed=meta(model.embed), lm_head=meta(model.lm_head),
                               final_norm=meta(model.final_norm), extra={k: meta(t) for k, t in model.extra.items()},
                               layers=[{k: meta(t) for k, t in lw.items()} for lw in model.layers])


