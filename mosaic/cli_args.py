"""The command line's grammar: argument types (one `error:` line for a bad value, never a
traceback) and the parser of `mosaic generate | plan | serve | chat | bench` (commands in cli.py)."""

from __future__ import annotations

import argparse
import re

from . import __version__
from .arg_types import at_least
from .cli_options import HelpFormatter, add_engine_args, add_sampling_args, budget_type, chunks_type
from .config import OFFLOAD_CHOICES, PARALLEL_CHOICES, PLANNER_CHOICES
from .loader import DEFAULT_MODEL
from .serve import commands as serve_commands

PLOT_SUFFIXES = (".png", ".svg", ".pdf")
DEFAULT_PROMPT = "sort 31415926="   # the bundled model's demo


class UsageError(Exception):
    """A command line argparse cannot read (the message is argparse's own)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2 from main(), never a SystemExit mid-way
        raise UsageError(f"{message} (see `{self.prog} --help`)")


_nonnegative = at_least(0)
_positive = at_least(1)


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: token ids are whole numbers, e.g. 17,3,11") from None
    if not ids:
        raise argparse.ArgumentTypeError("no token ids given")
    return ids


_NEGATIVE_IDS = re.compile(r"-\d[\d,\s-]*")


def join_negative_ids(argv: list[str]) -> list[str]:
    """`--ids -3,4` as `--ids=-3,4`: argparse reads a value that starts with '-' (and is not a
    plain negative number) as a flag and says `expected one argument`; joined, the value reaches
    the vocabulary check, which names the ids outside the vocabulary."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--ids" and i + 1 < len(argv) and _NEGATIVE_IDS.fullmatch(argv[i + 1]):
            out.append(f"--ids={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _fraction(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < f < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {f}")
    return f


def build_parser() -> argparse.ArgumentParser:
    fmt = HelpFormatter
    ap = _Parser(prog="mosaic", description="A memory-first inference engine for diffusion LLMs.",
                 formatter_class=fmt)
    ap.add_argument("--version", action="version", version=f"mosaic {__version__}")
    sub = ap.add_subparsers(dest="cmd", metavar="{generate,plan,serve,chat,bench}", parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text with a diffusion LLM", formatter_class=fmt,
                       description="Generate text. Unset sampling options come from the model's "
                                   "generation_config.json, then the published sampler's defaults.")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="checkpoint folder (or its config.json), bundled model (tiny-llada, tiny-dream, tiny-long) or "
                        "preset (llada-8b, illada-8b, dream-7b, llada-moe-7b, llada2-mini: random weights)")
    src = g.add_argument_group("prompts (one kind per run; repeat a flag for a batch)")
    src.add_argument("--prompt", action="append", help=f"prompt text (default with the default model "
                                                        f"tiny-llada: {DEFAULT_PROMPT!r})")
    src.add_argument("--prompt-file", action="append", metavar="FILE",
                     help="a file whose text is one prompt ('-': standard input)")
    src.add_argument("--ids", action="append", type=_ids, metavar="ID,ID,...",
                     help="a prompt as token ids, e.g. 17,3,11 (models without a tokenizer)")
    src.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    add_sampling_args(g)
    _engine_args(g)
    o = g.add_argument_group("output")
    o.add_argument("--memory-plot", metavar="FILE",
                   help=f"save one step's planned and measured memory as a plot ({', '.join(PLOT_SUFFIXES)})")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("plan", help="plan memory for a model on a device without running it", formatter_class=fmt,
                       description="One step's memory plan (--tokens) or the longest request that fits "
                                   "a budget (--budget) on --device. Loads no weights.")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="the device to plan for (default: the one present, cuda if a GPU is visible, else cpu); "
                        "cuda is charged as on an H200 (its measured CUDA context and workspace, the model in "
                        "bfloat16), cpu as the engine charges on a CPU (float32, no context)")
    p.add_argument("--model", default="llada-8b", help="preset, bundled model or checkpoint folder")
    p.add_argument("--tokens", type=_positive, help="N total tokens: a planning report for one step")
    p.add_argument("--masked", type=_positive, help="M masked tokens of the N (default: N/2)")
    p.add_argument("--planner", default=None, choices=PLANNER_CHOICES, help="one planner (default: all)")
    p.add_argument("--chunks", type=chunks_type, default=None, help="ATTN,FFN,LOGITS chunk counts (default 1,1,1)")
    p.add_argument("--budget", type=budget_type, help="capacity mode: the longest N that fits, e.g. 40GiB")
    p.add_argument("--prompt-ratio", type=_fraction, default=0.5, help="capacity: prompt share of N")
    p.add_argument("--context-bytes", type=budget_type, default=None,
                   help="CUDA context and fixed workspace to charge (default: the measured H200 value with "
                        "--device cuda, none on a CPU)")
    p.add_argument("--gpus", type=_positive, default=1, help="capacity per GPU under sequence parallelism")
    p.add_argument("--parallel", choices=PARALLEL_CHOICES, default="sequence",
                   help="with --gpus K: sequence (each GPU a slice of the positions) or tensor (each GPU 1/K of the "
                        "heads and FFN columns)")
    p.add_argument("--min-attention-rows", type=_nonnegative, default=0,
                   help="capacity with at least this many query rows per attention chunk (a speed floor)")
    p.add_argument("--kv-tier", choices=("device", "host"),
                   help="capacity with a Fast-dLLM block cache whose K/V live on the device or the host")
    p.add_argument("--offload", default=None, choices=["all", *OFFLOAD_CHOICES[2:]],
                   help="capacity with layer weights (and K/V) in host memory; all: a row per mode "
                        "with the predicted transfer-to-compute ratio (docs/OFFLOAD.md)")
    p.add_argument("--config", metavar="ENGINE.yaml",
                   help="engine options from a YAML file: its precision (per-layer FP8), prefetch_layers, "
                        "kv_block_rows and offload apply to the plan")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    serve_commands.add_parsers(sub, _engine_args)
    return ap


def _engine_args(g):
    e = add_engine_args(g)
    e.add_argument("--gpus", type=_positive, default=1,
                   help="processes, sequence parallel (or tensor parallel with --parallel tensor; NCCL on GPUs, "
                        "gloo on a CPU)")
