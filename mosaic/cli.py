"""`mosaic generate | plan | calibrate | serve | chat | bench` (also `python -m mosaic`).

Every mistake on the command line ends the same way: one `error: ...` line on stderr and exit
code 2, before a model is loaded or a token generated (argument syntax here, values in
EngineConfig / the sampler's check / the loader, each the one place for its kind of input)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import warnings
from pathlib import Path

import torch

from .cli_args import (  # noqa: F401  (re-exported: tests and scripts import them from here)
    DEFAULT_PROMPT,
    PLOT_SUFFIXES,
    UsageError,
    _fraction,
    _ids,
    _nonnegative,
    _positive,
    build_parser,
    join_negative_ids,
)
from .cli_calibrate import cmd_calibrate
from .cli_options import engine_config_from_args, sampling_options
from .config import (
    PLANNER_CHOICES,
    EngineConfig,
    name_defaults,
)
from .config_file import load_engine_config
from .engine import MosaicEngine, check_sparse_layers
from .errors import ConfigFileError, InputError, MosaicError, gib
from .graph.shard import world
from .graph.tensor import TensorShard
from .launch import SAFE_ENV, init_distributed, launch, rank, shutdown_distributed  # noqa: F401
from .loader import DEFAULT_MODEL, load
from .models import PRESETS
from .models.precision import apply_precision, quantize_embedding, ranges
from .models.step import Chunks
from .policy.capacity import capacity_report, plan_report, print_capacity
from .policy.capacity_modes import capacity_modes, print_modes
from .policy.offload import MODES
from .policy.precision import plan_precision
from .serve import commands as serve_commands


def read_prompts(args) -> list:
    """The prompts of one run: texts (--prompt, --prompt-file) or token-id lists (--ids)."""
    texts = list(args.prompt or [])
    for name in args.prompt_file or []:
        try:
            text = sys.stdin.read() if name == "-" else Path(name).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"--prompt-file {name}: cannot read it ({getattr(e, 'strerror', None) or e})") from e
        texts.append(text[:-1] if text.endswith("\n") else text)
    if texts and args.ids:
        raise InputError("give prompts as text (--prompt, --prompt-file) or as token ids (--ids), not both")
    if args.ids and args.chat:
        raise InputError("--chat wraps text in the chat template; it does not apply to --ids")
    if texts or args.ids:
        return texts or args.ids
    if args.model == DEFAULT_MODEL:
        return [DEFAULT_PROMPT]
    raise InputError("no prompt: give --prompt TEXT, --prompt-file FILE ('-': standard input) or --ids 1,2,3")


def check_plot_path(path: str | None) -> None:
    """Refuse a --memory-plot path that cannot be written, before anything runs."""
    if path is None:
        return
    p = Path(path).expanduser()
    if p.suffix.lower() not in PLOT_SUFFIXES:
        raise InputError(f"--memory-plot {path}: the plot is written as {', '.join(PLOT_SUFFIXES)} "
                         f"(by the file's suffix); e.g. {p.with_suffix('.png')}")
    if not p.parent.is_dir():
        raise InputError(f"--memory-plot {path}: the folder {p.parent} does not exist")
    if p.is_dir():
        raise InputError(f"--memory-plot {path} is a folder; give a file name, e.g. {p / 'step.png'}")
    if not os.access(p.parent, os.W_OK):
        raise InputError(f"--memory-plot {path}: the folder {p.parent} is not writable")


def cmd_generate(args) -> int:
    check_plot_path(args.memory_plot)
    if args.memory_plot and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise InputError("--memory-plot draws one process's memory: run it without --gpus")
    rank = init_distributed()
    as_json, quiet = (False, True) if rank else (args.json, args.no_progress)   # every rank computes; rank 0 speaks
    econf = engine_config_from_args(args, progress=False if quiet or as_json else None)
    prompts = read_prompts(args)
    if str(args.model) in PRESETS and any(isinstance(p, str) for p in prompts):   # before its weights exist
        raise InputError(f"preset {args.model} has random weights and no tokenizer, so prompts must be token ids "
                         "(--ids 1,2,3); a checkpoint folder brings its tokenizer.json")
    engine = MosaicEngine(args.model, econf)
    options = sampling_options(args)
    try:
        out = engine.generate(prompts if len(prompts) > 1 else prompts[0], chat=args.chat, **options)
    except KeyboardInterrupt:      # Ctrl-C: give the arena, pool and cap back before main says so
        engine.close()
        raise
    except InputError as e:        # a value no flag set is named as generation_config.json's
        raise InputError(name_defaults(str(e), options, engine.model.generation_defaults), param=e.param) from None
    if args.memory_plot:
        engine.memory_plot(prompts, out.config, args.memory_plot)
    if rank:
        return 0
    mem_label = "device memory peak" if engine.model.device.type == "cuda" else "process RSS peak"
    num_procs = world()[1]   # --gpus K: K processes, sequence (or tensor) parallel
    backend = "nccl" if engine.model.device.type == "cuda" else "gloo"
    where = str(engine.model.device) + (f" · {num_procs} processes ({backend})" if num_procs > 1 else "")
    rate = out.tokens.numel() / out.seconds if out.seconds > 0 else float("inf")
    shown = [p if isinstance(p, str) else " ".join(map(str, p)) + " | " for p in prompts]
    if as_json:
        print(json.dumps({"prompts": prompts, "texts": out.texts, "tokens": out.tokens.tolist(),
                          "path": out.path, "steps": out.steps, "seconds": out.seconds,
                          "tokens_per_second": rate, "peak_bytes": out.peak_device_bytes,
                          "lossy": out.lossy, "device": str(engine.model.device), "processes": num_procs,
                          "offload": out.offload,
                          "precision": engine.precision_report,
                          "options": {k: _jsonable(v) for k, v in vars(engine.config).items() if v is not None},
                          "memory": engine.memory_report(),
                          "steps_planned": [{"chunks": list(h.chunks), "plan_bytes": h.plan_bytes,
                                             "external_bytes": h.external_bytes, "sparse": h.key[8] is not None}
                                            for h in engine.history[:4]],
                          **({("speculative" if "speculate" in out.stats else "fast"): out.stats}
                             if out.stats else {})}))
        return 0
    word_level = getattr(getattr(engine.model, "tokenizer", None), "word_level", False)
    for p, t in zip(shown, out.texts):
        sep = " " if word_level and p and t and not p[-1].isspace() and not t[0].isspace() else ""
        print(f"{p}{sep}{t}")
    lossy = f" · lossy: {', '.join(out.lossy)}" if out.lossy else ""
    st = out.stats
    spec = f" · speculate {st['speculate']}: {st['nfe']} forwards, {st['tokens_per_forward']:.2f} tokens per " \
        "forward" if "speculate" in st else ""
    print(f"[{out.path}] {out.tokens.numel()} tokens, {out.steps} steps in {out.seconds:.2f} s "
          f"({rate:,.1f} tokens/s){spec} · {mem_label} {gib(out.peak_device_bytes)} · {where}{lossy}",
          file=sys.stderr)
    return 0


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


def check_gpus(gpus: int) -> None:
    """--gpus: at least 1, and no more than the GPUs here (any number of CPU processes)."""
    if gpus < 1:
        raise InputError(f"--gpus {gpus}: give at least 1")
    import torch
    if torch.cuda.is_available() and gpus > torch.cuda.device_count():
        raise InputError(f"--gpus {gpus}: this machine has {torch.cuda.device_count()} GPU(s)")


# sampling option names in the engine's messages, as the flags that set them (every message that
# raises InputError uses these words only as option names; "attention" or "device" also appear in
# prose, so engine options keep their names)
FLAGS = {n: "--" + n.replace("_", "-") for n in (
    "max_new_tokens", "gen_length", "block_length", "cfg_scale", "confidence_dtype", "logits_eos_inf",
    "confidence_eos_eot_inf", "alg_temp", "top_p", "top_k", "steps", "temperature", "seed", "remasking",
    "alg", "eps", "logits_kernel")}
FLAGS["memory_budget"] = "--budget"
_FLAG_NAMES = re.compile(r"\b(" + "|".join(FLAGS) + r")\b")


def as_flags(message: str) -> str:
    """An engine message for a command-line user: option names become the flags that set them."""
    return _FLAG_NAMES.sub(lambda m: FLAGS[m.group(1)], message)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    print(f"warning: {as_flags(str(message))}", file=sys.stderr)


PLANNED_FOR = {"cuda": "planned for cuda: charged as on an H200 (its measured CUDA context and workspace, bfloat16)",
               "cpu": "planned for cpu: charged as the engine charges on a CPU (float32, no CUDA context, no "
                      "allocator rounding); --device cuda gives the H200's figures"}


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


def _jsonable(v):
    """An engine option for --json: dataclasses (sparse, precision) as objects, tuples as lists."""
    import dataclasses
    if isinstance(v, (bool, int, float, str)):
        return v
    if dataclasses.is_dataclass(v):
        return {f.name: _jsonable(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    return str(v)


def _dispatch(args, argv) -> int:
    """Run the parsed command (several processes: relaunched under torchrun)."""
    if args.cmd in serve_commands.COMMANDS:
        return serve_commands.run(args)
    if args.cmd == "calibrate":
        return cmd_calibrate(args)
    if args.cmd == "generate":
        check_gpus(args.gpus)
        if args.gpus > 1 and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return launch(argv, args.gpus)
    return cmd_generate(args) if args.cmd == "generate" else cmd_plan(args)


def main(argv=None) -> int:
    """Run one command; 0 on success, 2 (one `error:` line on stderr) for any input Mosaic refuses."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(join_negative_ids(argv))
        if args.cmd is None:
            raise UsageError("choose a command: generate, plan, calibrate, serve, chat or bench (see `mosaic --help`)")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help and --version print and stop
        return e.code if isinstance(e.code, int) else 0
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning  # "warning: ..." lines, not source locations
        try:
            return _dispatch(args, argv)
        except MosaicError as e:
            if rank() == 0:  # every rank reaches the same error; rank 0 speaks
                text = str(e) if isinstance(e, ConfigFileError) else as_flags(str(e))   # the file's own keys
                print(f"error: {text}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for SIGINT (128 + 2)
            if rank() == 0:
                print("interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # `mosaic plan ... | head`: the reader left; nothing more to say
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (flushing at exit must not fail)
            return 0
        finally:
            shutdown_distributed()


if __name__ == "__main__":
    sys.exit(main())
