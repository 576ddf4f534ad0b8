"""The command line's grammar: argument types (one `error:` line for a bad value, never a
traceback) and the parser of `mosaic generate | plan | serve | chat | bench` (commands in cli.py)."""

from __future__ import annotations

import argparse

from . import __version__
from .arg_types import at_least
from .config import (
    ARENA_CHOICES,
    ATTENTION_CHOICES,
    CACHE_CHOICES,
    DTYPE_CHOICES,
    KV_TIER_CHOICES,
    LOGITS_KERNEL_CHOICES,
    OFFLOAD_CHOICES,
    PLANNER_CHOICES,
    parse_bytes,
)
from .errors import InputError
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


def _chunks(text: str) -> tuple[int, int, int]:
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) != 3 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: three positive counts ATTN,FFN,LOGITS, e.g. 4,2,1")
    return tuple(parts)


def _budget(text: str):
    # '0.5' is a fraction of the card; '1.5' (a float over 1, no unit) is refused like '2' by
    # parse_bytes, not read as 1.5 bytes (QA finding)
    is_float = text.replace(".", "", 1).isdigit() and "." in text
    value = float(text) if is_float and float(text) <= 1 else text
    try:
        parse_bytes(value, total=2**60)  # a fraction is checked against the card later
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: token ids are whole numbers, e.g. 17,3,11") from None
    if not ids:
        raise argparse.ArgumentTypeError("no token ids given")
    return ids


def _fraction(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < f < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {f}")
    return f


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    ap = _Parser(prog="mosaic", description="A memory-first inference engine for diffusion LLMs.",
                 formatter_class=fmt)
    ap.add_argument("--version", action="version", version=f"mosaic {__version__}")
    sub = ap.add_subparsers(dest="cmd", metavar="{generate,plan,serve,chat,bench}", parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text with a diffusion LLM", formatter_class=fmt,
                       description="Generate text. Unset sampling options come from the model's "
                                   "generation_config.json, then the published sampler's defaults.")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="checkpoint folder (or its config.json), bundled model (tiny-llada, tiny-dream, tiny-long) or "
                        "preset (llada-8b, dream-7b, llada-moe-7b: random weights)")
    src = g.add_argument_group("prompts (one kind per run; repeat a flag for a batch)")
    src.add_argument("--prompt", action="append", help=f"prompt text (default with the default model "
                                                        f"tiny-llada: {DEFAULT_PROMPT!r})")
    src.add_argument("--prompt-file", action="append", metavar="FILE",
                     help="a file whose text is one prompt ('-': standard input)")
    src.add_argument("--ids", action="append", type=_ids, metavar="ID,ID,...",
                     help="a prompt as token ids, e.g. 17,3,11 (models without a tokenizer)")
    src.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    s = g.add_argument_group("sampling (unset: generation_config.json, then the published defaults)")
    s.add_argument("--gen-length", "--max-new-tokens", dest="max_new_tokens", type=_positive,
                   help="tokens to generate (LLaDA's gen_length)")
    s.add_argument("--steps", type=_positive, help="denoising steps (default: one per generated token)")
    s.add_argument("--temperature", type=float, help="0: most likely tokens; > 0: sampled")
    s.add_argument("--seed", type=int, default=0, help="random seed (sampling runs repeat exactly)")
    s.add_argument("--block-length", type=_positive, help="LLaDA: semi-autoregressive block (default: one block)")
    s.add_argument("--cfg-scale", type=float, help="LLaDA: classifier-free guidance scale (default 0: off)")
    s.add_argument("--remasking", choices=["low_confidence", "random"], help="LLaDA: which positions to keep")
    s.add_argument("--confidence-dtype", choices=["model", "float64"],
                   help="LLaDA: confidences in the model dtype (current code) or float64 (older code)")
    s.add_argument("--alg", choices=["origin", "maskgit_plus", "topk_margin", "entropy"],
                   help="Dream: the remasking algorithm")
    s.add_argument("--alg-temp", type=float, help="Dream: > 0 draws positions by confidence, at this temperature")
    s.add_argument("--top-p", type=float, help="Dream: nucleus sampling threshold in (0, 1]")
    s.add_argument("--top-k", type=_positive, help="Dream: sample from the k most likely tokens")
    s.add_argument("--eps", type=float, help="Dream: the last timestep of the schedule (default 1e-3)")
    s.add_argument("--logits-eos-inf", action="store_true", default=None,
                   help="LLaDA: never generate end-of-text (Appendix B.4 of the LLaDA paper)")
    s.add_argument("--confidence-eos-eot-inf", action="store_true", default=None,
                   help="LLaDA: end-of-text / end-of-turn never win on confidence (Appendix B.4)")
    f = g.add_argument_group("fast decoding (Fast-dLLM; opt-in, lossy: docs/FAST_DECODING.md)")
    f.add_argument("--cache", choices=CACHE_CHOICES, help="block K/V cache: none, prefix or dual")
    f.add_argument("--threshold", type=float, help="commit every position at or above this confidence")
    f.add_argument("--factor", type=float, help="the factor rule (rank n needs 1 - factor/(n+1))")
    _engine_args(g)
    o = g.add_argument_group("output")
    o.add_argument("--memory-plot", metavar="FILE",
                   help=f"save one step's planned and measured memory as a plot ({', '.join(PLOT_SUFFIXES)})")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("plan", help="plan memory for a model without running it (CPU only)", formatter_class=fmt,
                       description="One step's memory plan (--tokens) or the longest request that fits "
                                   "a budget (--budget). Loads no weights.")
    p.add_argument("--model", default="llada-8b", help="preset, bundled model or checkpoint folder")
    p.add_argument("--tokens", type=_positive, help="N total tokens: a planning report for one step")
    p.add_argument("--masked", type=_positive, help="M masked tokens of the N (default: N/2)")
    p.add_argument("--planner", default=None, choices=PLANNER_CHOICES, help="one planner (default: all)")
    p.add_argument("--chunks", type=_chunks, default=None, help="ATTN,FFN,LOGITS chunk counts (default 1,1,1)")
    p.add_argument("--budget", type=_budget, help="capacity mode: the longest N that fits, e.g. 40GiB")
    p.add_argument("--prompt-ratio", type=_fraction, default=0.5, help="capacity: prompt share of N")
    p.add_argument("--context-bytes", type=_budget, default=None,
                   help="CUDA context and fixed workspace to charge (default: the measured H200 value)")
    p.add_argument("--gpus", type=_positive, default=1, help="capacity per GPU under sequence parallelism")
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
    e = g.add_argument_group("engine")
    e.add_argument("--config", metavar="ENGINE.yaml",
                   help="engine options from a YAML file (docs/CONFIG.md); flags given here override it")
    e.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    e.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="auto: bfloat16 on a GPU, float32 on a CPU")
    e.add_argument("--native", action="store_true", help="run the published forward and sampler (the baseline)")
    e.add_argument("--planner", default="greedy-size", choices=PLANNER_CHOICES, help="workspace planner")
    e.add_argument("--budget", type=_budget, help="device memory budget, e.g. 40GiB, 24GB or 0.5 of the card")
    e.add_argument("--chunks", type=_chunks, default=None, help="fixed ATTN,FFN,LOGITS chunks (default: searched)")
    e.add_argument("--min-attention-rows", type=_nonnegative, default=0,
                   help="at least this many query rows per attention chunk (faster at the longest lengths; "
                        "lowers the longest request that fits by ~1%% at 1024)")
    e.add_argument("--logits-kernel", default="auto", choices=LOGITS_KERNEL_CHOICES,
                   help="masked-logits kernel: auto (Triton on a GPU), triton or torch")
    e.add_argument("--elementwise-kernel", default="auto", choices=LOGITS_KERNEL_CHOICES,
                   help="RMSNorm/RoPE/SwiGLU: auto (fused Triton on a GPU, the same bits as PyTorch's op "
                        "chains), triton or torch")
    e.add_argument("--attention", default="sdpa", choices=ATTENTION_CHOICES,
                   help="sdpa: PyTorch's kernel order (the reference's); cudnn: cuDNN's fused attention first; "
                        "triton: Mosaic's kernel, output written into the plan (both opt-in: bf16 rounding "
                        "may differ)")
    e.add_argument("--arena", default="auto", choices=ARENA_CHOICES,
                   help="workspace: auto (virtual memory on a GPU), host or vmm")
    e.add_argument("--kv-tier", default="auto", choices=KV_TIER_CHOICES,
                   help="where a block cache's K/V live: auto (device, cold layers on the host when short)")
    e.add_argument("--offload", default="off", choices=OFFLOAD_CHOICES,
                   help="layer weights (and K/V) in host memory, streamed in: auto takes the least "
                        "streaming that fits the budget (docs/OFFLOAD.md)")
    e.add_argument("--prefetch-layers", type=_positive, default=1, help="offload: layers copied ahead")
    e.add_argument("--kv-block-rows", type=_positive, default=32768,
                   help="offload weights+kv: key rows per block streamed from host memory")
    e.add_argument("--gpus", type=_positive, default=1,
                   help="sequence-parallel processes (torchrun; NCCL on GPUs, gloo on a CPU)")
