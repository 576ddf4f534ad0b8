"""`mosaic generate | plan` (also `python -m mosaic`)."""

from __future__ import annotations

import argparse
import json
import sys

from .config import (
    ARENA_CHOICES,
    ATTENTION_CHOICES,
    LOGITS_KERNEL_CHOICES,
    OFFLOAD_CHOICES,
    PLANNER_CHOICES,
    EngineConfig,
)
from .config_file import load_engine_config
from .engine import MosaicEngine
from .errors import MosaicError, gib
from .loader import DEFAULT_MODEL, load
from .memory.planner import PLANNERS
from .models.precision import apply_precision, quantize_embedding, ranges
from .models.step import Chunks
from .policy.capacity import capacity_report, plan_report, print_capacity
from .policy.capacity_modes import capacity_modes, print_modes
from .policy.offload import MODES
from .policy.precision import plan_precision


def _chunks(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in text.split(",")]
    if len(parts) != 3 or min(parts) < 1:
        raise argparse.ArgumentTypeError("--chunks takes three positive counts: ATTN,FFN,LOGITS")
    return tuple(parts)


def _budget(text: str):
    try:
        return float(text) if "." in text and text.replace(".", "").isdigit() else text
    except ValueError:
        return text


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mosaic", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text with a diffusion LLM")
    g.add_argument("--model", default="tiny-llada",
                   help="checkpoint folder, bundled model (tiny-llada, tiny-dream, tiny-long) or preset")
    g.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    g.add_argument("--gen-length", "--max-new-tokens", dest="max_new_tokens", type=int)
    g.add_argument("--steps", type=int)
    g.add_argument("--block-length", type=int)
    g.add_argument("--temperature", type=float)
    g.add_argument("--cfg-scale", type=float)
    g.add_argument("--remasking", choices=["low_confidence", "random"])
    g.add_argument("--confidence-dtype", choices=["model", "float64"])
    g.add_argument("--alg", choices=["origin", "maskgit_plus", "topk_margin", "entropy"])
    g.add_argument("--alg-temp", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--config", metavar="ENGINE.yaml",
                   help="engine options from a YAML file (docs/CONFIG.md); flags given here override it")
    _engine_args(g)
    g.add_argument("--memory-plot", metavar="FILE.png",
                   help="save the planned and measured memory timeline of one step")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--gpus", type=int, default=1,
                   help="sequence-parallel processes (torchrun; NCCL on GPUs, gloo on a CPU)")

    p = sub.add_parser("plan", help="plan memory for a model without running it (CPU only)")
    p.add_argument("--model", default="llada-8b")
    p.add_argument("--tokens", type=int, help="N total tokens (a planning report for one step)")
    p.add_argument("--masked", type=int, help="M masked tokens (default N/2)")
    p.add_argument("--planner", default=None, choices=PLANNERS)
    p.add_argument("--chunks", type=_chunks, default=None, help="ATTN,FFN,LOGITS chunk counts")
    p.add_argument("--budget", type=_budget, help="capacity mode: longest N that fits, e.g. 40GiB")
    p.add_argument("--prompt-ratio", type=float, default=0.5)
    p.add_argument("--context-bytes", type=_budget, default=None,
                   help="CUDA context and fixed workspace to charge (default: measured H200 value)")
    p.add_argument("--gpus", type=int, default=1, help="capacity per GPU under sequence parallelism")
    p.add_argument("--min-attention-rows", type=int, default=0,
                   help="capacity with at least this many query rows per attention chunk (a speed floor)")
    p.add_argument("--offload", default=None, choices=["all", *OFFLOAD_CHOICES[2:]],
                   help="capacity with layer weights (and K/V) in host memory; all: a row per mode "
                        "with the predicted transfer-to-compute ratio")
    p.add_argument("--config", metavar="ENGINE.yaml",
                   help="engine options from a YAML file: its precision (per-layer FP8), prefetch_layers, "
                        "kv_block_rows and offload apply to the plan")
    p.add_argument("--json", action="store_true")
    return ap


# NVLink multicast stays off in every launch (a program that uses it can take a shared host's
# GPUs out of service)
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def launch(argv: list[str], gpus: int) -> int:
    """Re-run this command under torchrun with `gpus` processes."""
    import os
    import subprocess
    rest = [a for i, a in enumerate(argv) if not (a == "--gpus" or (i and argv[i - 1] == "--gpus"))
            and not a.startswith("--gpus=")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
           "-m", "mosaic", *rest]
    return subprocess.run(cmd, env={**os.environ, **SAFE_ENV}).returncode


def init_distributed() -> int:
    """Join the process group torchrun set up; returns this process's rank (0 alone)."""
    import os
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0
    import torch
    import torch.distributed as dist
    os.environ.update(SAFE_ENV)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank()


def _engine_args(g):
    g.add_argument("--device", default="auto")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--native", action="store_true", help="the published forward and sampler")
    g.add_argument("--planner", default="greedy-size", choices=PLANNER_CHOICES)
    g.add_argument("--budget", type=_budget, help="device memory budget, e.g. 40GiB or 0.5")
    g.add_argument("--chunks", type=_chunks, default=None, help="fixed ATTN,FFN,LOGITS chunks")
    g.add_argument("--min-attention-rows", type=int, default=0,
                   help="at least this many query rows per attention chunk (speed; lowers the longest fit)")
    g.add_argument("--logits-kernel", default="auto", choices=LOGITS_KERNEL_CHOICES)
    g.add_argument("--elementwise-kernel", default="auto", choices=LOGITS_KERNEL_CHOICES,
                   help="fused Triton RMSNorm/RoPE/SwiGLU (same bits as PyTorch's op chains) or torch")
    g.add_argument("--attention", default="sdpa", choices=ATTENTION_CHOICES,
                   help="sdpa: PyTorch's kernel order (the reference's); cudnn: cuDNN's fused attention "
                        "first on Hopper GPUs (opt-in: bf16 rounding differs, not yet measured end to end)")
    g.add_argument("--arena", default="auto", choices=ARENA_CHOICES)
    g.add_argument("--offload", default="off", choices=OFFLOAD_CHOICES,
                   help="layer weights (and K/V) in host memory, streamed in: auto takes the least "
                        "streaming that fits the budget (docs/OFFLOAD.md)")
    g.add_argument("--prefetch-layers", type=int, default=1, help="offload: layers copied ahead")
    g.add_argument("--kv-block-rows", type=int, default=32768, help="weights+kv: key rows per streamed block")


def cmd_generate(args) -> int:
    rank = init_distributed()
    if rank:  # every rank computes; rank 0 speaks
        args.json, args.no_progress, args.memory_plot = False, True, None
    fields = dict(device=args.device, dtype=args.dtype, native=args.native,
                  planner=args.planner, memory_budget=args.budget, chunks=args.chunks,
                  min_attention_rows=args.min_attention_rows,
                  logits_kernel=args.logits_kernel, elementwise_kernel=args.elementwise_kernel,
                  attention=args.attention, arena=args.arena, offload=args.offload,
                  prefetch_layers=args.prefetch_layers, kv_block_rows=args.kv_block_rows,
                  progress=not args.no_progress and not args.json)
    if args.config:  # the file's values, overridden by the flags given on the command line
        defaults = vars(build_parser().parse_args(["generate"]))
        given = {k: v for k, v in fields.items() if v != defaults.get({"memory_budget": "budget"}.get(k, k))}
        econf = load_engine_config(args.config, **given)
    else:
        econf = EngineConfig(**fields)
    engine = MosaicEngine(args.model, econf)
    prompts = args.prompt or (["sort 31415926="] if args.model == DEFAULT_MODEL else None)
    if not prompts:
        raise MosaicError("--prompt is required for this model")
    opts = {k: getattr(args, k) for k in ("cfg_scale", "remasking", "confidence_dtype", "alg",
                                          "alg_temp", "top_p", "top_k", "seed")}
    out = engine.generate(prompts if len(prompts) > 1 else prompts[0],
                          max_new_tokens=args.max_new_tokens, steps=args.steps,
                          block_length=args.block_length, temperature=args.temperature,
                          chat=args.chat, **{k: v for k, v in opts.items() if v is not None})
    if args.memory_plot:
        engine.memory_plot(prompts, out.config, args.memory_plot)
    if rank:
        return 0
    mem_label = "device memory peak" if engine.model.device.type == "cuda" else "process RSS peak"
    if args.json:
        print(json.dumps({"prompts": prompts, "texts": out.texts, "path": out.path,
                          "steps": out.steps, "seconds": out.seconds,
                          "peak_bytes": out.peak_device_bytes, "lossy": out.lossy,
                          "device": str(engine.model.device), "offload": out.offload,
                          "precision": engine.precision_report}))
        return 0
    for p, t in zip(prompts, out.texts):
        print(f"{p}{t}")
    lossy = f" · lossy: {', '.join(out.lossy)}" if out.lossy else ""
    print(f"[{out.path}] {out.steps} steps in {out.seconds:.2f} s · {mem_label} "
          f"{gib(out.peak_device_bytes)} · {engine.model.device}{lossy}", file=sys.stderr)
    return 0


def cmd_plan(args) -> int:
    econf = load_engine_config(args.config) if args.config else EngineConfig()
    pc = econf.precision
    # explicit ranges plan on meta tensors; a sensitivity choice needs the weights themselves
    model = load(args.model, device="cpu" if pc is not None and pc.auto else "meta")
    precision = None
    if pc is not None:
        precision = plan_precision(model, pc)
        apply_precision(model, precision["dtypes"])
        if pc.embed == "fp8":
            quantize_embedding(model)
        precision["ranges"] = ranges(model.precision)
        if model.device.type != "meta":
            model = _as_meta(model)
    if args.budget is not None:
        kw = dict(prompt_ratio=args.prompt_ratio, planner=args.planner or "greedy-size",
                  context_bytes=args.context_bytes, world=args.gpus, min_attention_rows=args.min_attention_rows)
        offload = args.offload or (econf.offload if econf.offload not in ("off", "auto") else None)
        if offload is None:
            rep = capacity_report(model, args.budget, **kw)
            text = print_capacity(rep)
        else:
            modes = MODES if offload == "all" else (offload,)
            rep = capacity_modes(model, args.budget, modes, econf, **kw)
            text = print_modes(rep)
        if precision is not None:
            rep["precision"] = precision
            text += "\nprecision: " + ", ".join(f"layers {r['layers'][0]}-{r['layers'][1]} {r['dtype']}"
                                                for r in precision["ranges"]) + \
                f" · weights {gib(precision['weight_bytes'])} (16-bit: {gib(precision['weight_bytes_16bit'])})"
        print(json.dumps(rep) if args.json else text)
        return 0
    if not args.tokens:
        raise MosaicError("mosaic plan needs --tokens N (a planning report) or --budget (capacity)")
    planners = [args.planner] if args.planner else list(PLANNERS[:4])
    rep = plan_report(model, args.tokens, args.masked or args.tokens // 2, planners,
                      Chunks(*(args.chunks or (1, 1, 1))))
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


def _as_meta(model):
    """The same model on meta tensors (capacity planning needs only shapes and dtypes)."""
    import torch
    meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")  # noqa: E731
    model.embed, model.lm_head, model.final_norm = meta(model.embed), meta(model.lm_head), meta(model.final_norm)
    model.extra = {k: meta(t) for k, t in model.extra.items()}
    model.layers[:] = [{k: meta(t) for k, t in lw.items()} for lw in model.layers]
    return model


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    import os
    if args.cmd == "generate" and args.gpus > 1 and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return launch(argv, args.gpus)
    try:
        return cmd_generate(args) if args.cmd == "generate" else cmd_plan(args)
    except MosaicError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
