"""The command line's grammar: argument types (one `error:` line for a bad value, never a
traceback) and the parser of `mosaic generate | plan | calibrate | serve | chat | bench` (commands in cli.py)."""

from __future__ import annotations

import argparse
import re

from . import __version__
from .arg_types import at_least, number_in
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

    def parse_args(self, args=None, namespace=None):
        # argparse names extra arguments from the top parser ("see `mosaic --help`"), though the
        # flags a user mistyped belong to the command: point to `mosaic generate --help`
        known, extra = self.parse_known_args(args, namespace)
        if extra:
            command = getattr(known, "cmd", None)
            self.prog = f"{self.prog} {command}" if command else self.prog
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return known


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
_NEGATIVE_VALUES = {"--ids": _NEGATIVE_IDS, "--budget": re.compile(r"-[\d.]\S*")}


def join_negative_ids(argv: list[str]) -> list[str]:
    """`--ids -3,4` as `--ids=-3,4` (and `--budget -1GiB` as `--budget=-1GiB`): argparse reads a
    value that starts with '-' (and is not a plain negative number) as a flag and says `expected
    one argument`; joined, the value reaches its own check, which says what is wrong with it (ids
    outside the vocabulary, a budget that must be positive)."""
    out, i = [], 0
    while i < len(argv):
        pattern = _NEGATIVE_VALUES.get(argv[i])
        if pattern is not None and i + 1 < len(argv) and pattern.fullmatch(argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
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
    sub = ap.add_subparsers(dest="cmd", metavar="{generate,plan,calibrate,serve,chat,bench}", parser_class=_Parser)

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
    src.add_argument("--messages", action="append", metavar="FILE",
                     help="a conversation: a JSON file of [{\"role\": ..., \"content\": ...}, ...] rendered by the "
                          "model's chat template ('-': standard input)")
    src.add_argument("--continue-final-message", action="store_true",
                     help="chat: leave the last message open and continue it (a partial assistant turn: the answer "
                          "goes on from its text) instead of answering it in a new turn")
    src.add_argument("--no-generation-prompt", action="store_true",
                     help="chat: do not add the template's opening of an assistant turn after the messages")
    add_sampling_args(g)
    c = g.add_argument_group("output constraint (one; docs/STRUCTURED.md; pip install 'mosaic-dllm[structured]')")
    c.add_argument("--json-schema", metavar="FILE", help="the answer is JSON valid against this JSON Schema file")
    c.add_argument("--regex", metavar="RE", help="the whole answer matches this regular expression")
    c.add_argument("--choice", nargs="+", metavar="TEXT", help="the answer is one of these strings")
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
    _calibrate_parser(sub, fmt)
    serve_commands.add_parsers(sub, _engine_args)
    return ap


_recall = number_in(lambda f: 0 < f <= 1, "in (0, 1] (the share of attention mass kept)")
_points = number_in(lambda f: 0 <= f < 100, "in [0, 100) accuracy points")
_nats = number_in(lambda f: 0 <= f < float("inf"), ">= 0 nats")


def _list(kind):
    def parse(text: str):
        items = [t for t in text.replace(",", " ").split() if t]
        if not items:
            raise argparse.ArgumentTypeError("give at least one value, comma separated")
        try:
            return [kind(t) for t in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: comma-separated {kind.__name__} values, e.g. "
                                             + ("4096,8192" if kind is int else "kv,niah,copy")) from None
    return parse


def _calibrate_parser(sub, fmt):
    c = sub.add_parser("calibrate", help="choose block-sparse attention per layer for a quality target",
                       formatter_class=fmt,
                       description="Run MODEL densely over calibration prompts, measure what each sparse pattern "
                                   "keeps per layer and head (attention-mass recall, block entropy, one-layer output "
                                   "error), choose per layer the cheapest pattern meeting the target and write an "
                                   "engine YAML (docs/CONFIG.md \"Choosing sparsity with mosaic calibrate\").")
    c.add_argument("model", nargs="?", default="tiny-long",
                   help="bundled model or checkpoint folder (a model trained on the long-context tasks, or any "
                        "model with --prompts; default: tiny-long)")
    c.add_argument("--out", required=True, metavar="ENGINE.yaml", help="the engine YAML to write")
    c.add_argument("--json", metavar="FILE", help="also write the full record (every recall) as JSON")
    src = c.add_argument_group("calibration prompts (one kind)")
    src.add_argument("--prompts", metavar="FILE", help="prompts: .jsonl (a string or {\"prompt\": ...} a line) or "
                                                       "text, one a line")
    src.add_argument("--tasks", type=_list(str), default=None,
                     help="long-context tasks kv,niah,copy (a model trained on them: tiny-long); the default "
                          "without --prompts")
    src.add_argument("--lengths", type=_list(int), default=[4096], help="task context lengths (default 4096)")
    src.add_argument("--n", type=_positive, default=8, help="canvases per task and length (default 8)")
    src.add_argument("--answer-len", type=_positive, default=32, help="masked slots after each prompt of --prompts")
    t = c.add_argument_group("quality target")
    t.add_argument("--min-recall", type=_recall, default=0.95,
                   help="a layer's pattern keeps at least this share of the dense attention mass (default 0.95)")
    t.add_argument("--max-kl", type=_nats, default=0.01,
                   help="or changes the masked positions' distribution by at most this KL with only that layer "
                        "sparse (nats; default 0.01; 0: recall alone)")
    t.add_argument("--max-loss", type=_points, default=None,
                   help="and, on the tasks, loses at most this many accuracy points against dense on every task and "
                        "length (measured; sparse layers are made dense, the most lossy first, until it holds)")
    t.add_argument("--eval-n", type=_positive, default=None, help="held-out prompts per task and length (default --n)")
    t.add_argument("--no-verify", action="store_true", help="skip the held-out accuracy (tasks only)")
    o = c.add_argument_group("options")
    o.add_argument("--block", type=int, default=None, help="sparse block (default 128 at >= 8k tokens, else 64)")
    o.add_argument("--dense-steps", type=_nonnegative, default=1, help="first denoising steps kept dense (default 1)")
    o.add_argument("--estimates", type=_list(str), default=["minmax", "rows"], help="block estimates to try")
    o.add_argument("--threads", type=_positive, default=None, help="CPU threads (torch.set_num_threads)")
    o.add_argument("--device", default="cpu", help="where to run (default cpu)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def _engine_args(g):
    e = add_engine_args(g)
    e.add_argument("--gpus", type=_positive, default=1,
                   help="processes, sequence parallel (or tensor parallel with --parallel tensor; NCCL on GPUs, "
                        "gloo on a CPU)")
