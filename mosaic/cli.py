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
from .cli_plan import cmd_plan
from .config import (
    name_defaults,
)
from .engine import MosaicEngine
from .errors import ConfigFileError, InputError, MosaicError, gib
from .graph.shard import world
from .launch import SAFE_ENV, init_distributed, launch, rank, shutdown_distributed  # noqa: F401
from .loader import BUNDLED, DEFAULT_MODEL, host_available_bytes, planned_weight_bytes, resolve_dtype, resolve_folder
from .models import PRESETS
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
    conversations = [read_messages(name) for name in args.messages or []]
    if sum(map(bool, (texts, args.ids, conversations))) > 1:
        raise InputError("give prompts as text (--prompt, --prompt-file), as token ids (--ids) or as conversations "
                         "(--messages), one kind per run")
    if args.ids and args.chat:
        raise InputError("--chat wraps text in the chat template; it does not apply to --ids")
    if (args.continue_final_message or args.no_generation_prompt) and not (args.chat or conversations):
        raise InputError("--continue-final-message / --no-generation-prompt shape a chat: give --messages FILE, "
                         "or --chat with --prompt")
    if texts or args.ids or conversations:
        return texts or args.ids or conversations
    if args.model == DEFAULT_MODEL:
        return [DEFAULT_PROMPT]
    if str(args.model) not in PRESETS and str(args.model) not in BUNDLED:
        resolve_folder(args.model)        # a model that does not exist is the first thing wrong
    raise InputError("no prompt: give --prompt TEXT, --prompt-file FILE ('-': standard input) or --ids 1,2,3")


def read_messages(name: str) -> list:
    """--messages FILE: a JSON list of chat messages (InputError naming the file otherwise; the
    roles and contents are checked with the prompt)."""
    try:
        data = json.loads(sys.stdin.read() if name == "-" else Path(name).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--messages {name}: cannot read it ({getattr(e, 'strerror', None) or e})") from e
    except json.JSONDecodeError as e:
        raise InputError(f"--messages {name}: not valid JSON ({e})") from e
    if not isinstance(data, list) or not data or not all(isinstance(m, dict) for m in data):
        raise InputError(f"--messages {name}: expected a non-empty JSON list of {{\"role\": ..., \"content\": ...}} "
                         "objects")
    return data


def constraint_options(args) -> dict:
    """generate()'s output constraint from --json-schema FILE / --regex / --choice (InputError for
    an unreadable schema file; several constraints are refused by the engine)."""
    out = {}
    if args.json_schema is not None:
        try:
            out["json_schema"] = json.loads(Path(args.json_schema).read_text())
        except OSError as e:
            raise InputError(f"--json-schema {args.json_schema}: cannot read it ({e.strerror})") from None
        except ValueError as e:
            raise InputError(f"--json-schema {args.json_schema}: not valid JSON ({e})") from None
    if args.regex is not None:
        out["regex"] = args.regex
    if args.choice is not None:
        out["choice"] = args.choice
    return out


def stats_fields(stats: dict) -> dict:
    """--json's statistics: the constraint's under 'structured', the sampler's under 'speculative'
    (self-speculative decoding) or 'fast' (Fast-dLLM)."""
    stats = dict(stats)
    out = {"structured": stats.pop("structured")} if "structured" in stats else {}
    if stats:
        out["speculative" if "speculate" in stats else "fast"] = stats
    return out


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
        out = engine.generate(prompts if len(prompts) > 1 else prompts[0], chat=args.chat,
                              continue_final_message=args.continue_final_message,
                              add_generation_prompt=False if args.no_generation_prompt else None, **options,
                              **constraint_options(args))
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
    shown = [p if isinstance(p, str) else (p[-1].get("content", "") if args.continue_final_message else "")
             if p and isinstance(p[0], dict) else " ".join(map(str, p)) + " | " for p in prompts]
    if as_json:
        print(json.dumps({"prompts": prompts, "texts": out.texts, "tokens": out.tokens.tolist(),
                          "path": out.path, "steps": out.steps, "seconds": out.seconds,
                          "tokens_per_second": rate, "peak_bytes": out.peak_device_bytes,
                          "lossy": out.lossy, "device": str(engine.model.device), "processes": num_procs,
                          "offload": out.offload, "beyond_trained_length": out.beyond_trained_length,
                          "precision": engine.precision_report,
                          "options": {k: _jsonable(v) for k, v in vars(engine.config).items() if v is not None},
                          "memory": engine.memory_report(),
                          "steps_planned": [{"chunks": list(h.chunks), "plan_bytes": h.plan_bytes,
                                             "external_bytes": h.external_bytes, "sparse": h.key[8] is not None}
                                            for h in engine.history[:4]],
                          **stats_fields(out.stats)}))
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


def check_gpus(gpus: int, model=None, device: str = "auto", dtype: str = "auto") -> None:
    """--gpus: at least 1, and no more than the GPUs here; on a CPU no more processes than twice
    the cores (at least 4), and no more copies of the model's weights than the host's available
    memory holds (each process loads its own), checked before any process starts."""
    if gpus < 1:
        raise InputError(f"--gpus {gpus}: give at least 1")
    if torch.cuda.is_available() and str(device) != "cpu":
        if gpus > torch.cuda.device_count():
            raise InputError(f"--gpus {gpus}: this machine has {torch.cuda.device_count()} GPU(s)")
        return
    cores = os.cpu_count() or 1
    most = max(2 * cores, 4)    # oversubscribed at most 2x: 3 gloo ranks on 2 cores run (the tests do), 64 do not
    if gpus > most:
        raise InputError(f"--gpus {gpus} on a CPU starts {gpus} processes (gloo), but this machine has {cores} CPU "
                         f"core(s): give at most {most}")
    sizes = planned_weight_bytes(model, resolve_dtype(dtype, torch.device("cpu"))) if model is not None else None
    have = host_available_bytes()
    if sizes is not None and have is not None and gpus > 1 and sizes[0] * gpus > have:
        raise InputError(f"--gpus {gpus} on a CPU loads the weights once per process: {gpus} x {gib(sizes[0])}; "
                         f"{gib(have)} of host memory is available: at most {max(1, have // sizes[0])} processes")


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


def _jsonable(v):
    """An engine option for --json: dataclasses (sparse, precision) as objects, tuples as lists."""
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
        check_gpus(args.gpus, args.model, args.device or "auto", args.dtype or "auto")
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
