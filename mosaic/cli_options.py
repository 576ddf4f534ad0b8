"""Command-line flags derived from the configs: the sampling flags from GenerationConfig's
declared options (config/generation.py), the engine flags from one table over EngineConfig's
fields. `mosaic generate | serve | chat | bench` share them.

Every flag defaults to unset (None): a flag given on the command line always wins over a
`--config FILE` value, even when it equals the built-in default, and an unset flag leaves the
file's (or EngineConfig's) value alone. Help texts show the built-in default."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields
from pathlib import Path

from .arg_types import at_least
from .config import (
    ARENA_CHOICES,
    ATTENTION_CHOICES,
    DTYPE_CHOICES,
    FUSED_CHOICES,
    GENERATION_DEFAULTS,
    KV_TIER_CHOICES,
    LOGITS_KERNEL_CHOICES,
    MOE_KERNEL_CHOICES,
    OFFLOAD_CHOICES,
    OPTIONS,
    PARALLEL_CHOICES,
    PLANNER_CHOICES,
    TRANSIENT_POOL_CHOICES,
    VARLEN_KERNEL_CHOICES,
    EngineConfig,
    parse_bytes,
)
from .config_file import load_engine_config
from .errors import InputError

_ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}
SAMPLING_GROUPS = {None: "sampling", "LLaDA": "sampling", "Dream": "sampling", "block-diffusion": "sampling",
                   "Fast-dLLM": "fast decoding (Fast-dLLM; opt-in, lossy: docs/FAST_DECODING.md)",
                   "self-speculative": "self-speculative decoding (opt-in, exact: docs/MODELS.md)"}


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with '(default: X)' added only where the default says something (never
    '(default: None)' after a help text that already explains the unset case)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or \
                action.option_strings == [] or action.nargs == 0:
            return text
        return text + " (default: %(default)s)"


def budget_type(text: str):
    """An argparse type for memory sizes: '40GiB', '24GB', bytes with a unit, or a fraction
    0 < f <= 1 of the card. '1.5' (a float over 1, no unit) is refused like '2' by parse_bytes,
    not read as 1.5 bytes."""
    is_float = text.replace(".", "", 1).isdigit() and "." in text
    value = float(text) if is_float and float(text) <= 1 else text
    try:
        parse_bytes(value, total=2**60)  # a fraction is checked against the card later
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def chunks_type(text: str) -> tuple[int, int, int]:
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) != 3 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: three positive counts ATTN,FFN,LOGITS, e.g. 4,2,1")
    return tuple(parts)


def writable_file(text: str) -> str:
    """An argparse type: a file path whose folder exists and can be written (checked before any
    work, so a long run never ends in a traceback at its last line)."""
    folder = Path(text).expanduser().resolve().parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {str(folder)!r} is not writable")
    return text


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    return value   # NaN and infinity reach the option's own check, which names the option


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def add_sampling_args(parser, only: tuple[str, ...] | None = None) -> None:
    """One flag per GenerationConfig option (only: these option names), grouped by sampler."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, opt in OPTIONS.items():
        if only is not None and name not in only or opt.flags == ():
            continue
        title = SAMPLING_GROUPS[opt.sampler]
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        flags = opt.flags or ("--" + name.replace("_", "-"),)
        text = (f"{opt.sampler}: " if opt.sampler in ("LLaDA", "Dream", "block-diffusion") else "") + opt.help
        if opt.kind is bool:   # on by default: --name / --no-name
            on = getattr(GENERATION_DEFAULTS, name) is True
            group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction if on else "store_true",
                               default=None, help=text)
            continue
        kind = {int: at_least(int(opt.least)) if opt.least is not None else _whole, float: _number,
                str: str}[opt.kind]
        group.add_argument(*flags, dest=name, type=kind, choices=opt.choices, default=opt.cli_default, help=text,
                           metavar=None if opt.choices else _metavar(flags[0]))


def sampling_options(args) -> dict:
    """The sampling options given on the command line (unset ones left to the engine)."""
    return {n: getattr(args, n) for n in OPTIONS if getattr(args, n, None) is not None}


# flag -> (EngineConfig field, argparse type or None, choices, help)
ENGINE_FLAGS = {
    "--device": ("device", None, None, "auto, cpu, cuda or cuda:N"),
    "--dtype": ("dtype", None, DTYPE_CHOICES, "auto: bfloat16 on a GPU, float32 on a CPU"),
    "--planner": ("planner", None, PLANNER_CHOICES, "workspace planner"),
    "--budget": ("memory_budget", budget_type, None, "device memory budget, e.g. 40GiB, 24GB or 0.5 of the card"),
    "--chunks": ("chunks", chunks_type, None, "fixed ATTN,FFN,LOGITS chunks (default: searched)"),
    "--min-attention-rows": ("min_attention_rows", at_least(0), None,
                             "at least this many query rows per attention chunk (faster at the longest lengths; "
                             "lowers the longest request that fits by ~1%% at 1024)"),
    "--logits-kernel": ("logits_kernel", None, LOGITS_KERNEL_CHOICES,
                        "masked-logits kernel: auto (Triton on a GPU), triton or torch"),
    "--elementwise-kernel": ("elementwise_kernel", None, LOGITS_KERNEL_CHOICES,
                             "RMSNorm/RoPE/SwiGLU: auto (fused Triton on a GPU, the same bits as PyTorch's op "
                             "chains), triton or torch"),
    "--moe-kernel": ("moe_kernel", None, MOE_KERNEL_CHOICES,
                     "MoE experts: auto (grouped GEMM where it needs no host sync, else the loop), loop "
                     "(one expert at a time, the reference), grouped (the loop's bits) or triton (fused, "
                     "opt-in: its rounding differs)"),
    "--varlen-kernel": ("varlen_kernel", None, VARLEN_KERNEL_CHOICES,
                        "batched block steps' attention over every sequence: auto (the per-sequence loop on a "
                        "CPU; flash, else efficient, else the loop on a GPU; triton with --batch-invariant), loop "
                        "(one call per sequence, the reference), triton (Mosaic's, batch-invariant), or flash, "
                        "efficient, gather (labelled: tokens may differ from the request alone)"),
    "--attention": ("attention", None, ATTENTION_CHOICES,
                    "sdpa: PyTorch's kernel order (the reference's); cudnn: cuDNN's fused attention first; "
                    "triton: Mosaic's kernel, output written into the plan (both opt-in: bf16 rounding may differ)"),
    "--arena": ("arena", None, ARENA_CHOICES, "workspace: auto (virtual memory on a GPU), host or vmm"),
    "--transient-pool": ("transient_pool", None, TRANSIENT_POOL_CHOICES,
                         "under a budget on a GPU, where a step's out-of-plan transients live: auto (a private "
                         "MemPool where torch has one), mempool or shared (a segment of the default pool)"),
    "--kv-tier": ("kv_tier", None, KV_TIER_CHOICES,
                  "where a block cache's K/V live: auto (device, cold layers on the host when short)"),
    "--offload": ("offload", None, OFFLOAD_CHOICES,
                  "layer weights (and K/V) in host memory, streamed in: auto takes the least streaming that "
                  "fits the budget (docs/OFFLOAD.md)"),
    "--prefetch-layers": ("prefetch_layers", at_least(1), None, "offload: layers copied ahead"),
    "--kv-block-rows": ("kv_block_rows", at_least(1), None,
                        "offload weights+kv: key rows per block streamed from host memory"),
    "--batch-invariant": ("batch_invariant", "flag", None,
                          "every sequence's tokens independent of its batch-mates: fixed-tile GEMMs without "
                          "split-K, fixed split counts (docs/MODELS.md; slower)"),
    "--parallel": ("parallel", None, PARALLEL_CHOICES,
                   "with --gpus K: what the processes split: sequence (each holds a slice of the positions) or "
                   "tensor (each holds 1/K of every layer's heads and FFN columns; docs/PARALLEL.md)"),
    "--threads": ("threads", at_least(1), None, "CPU: intra-op threads (default: 1 for a model under 256 MiB, "
                  "else PyTorch's)"),
    "--fused-projections": ("fused_projections", None, FUSED_CHOICES,
                            "auto: a block-cache step's gate and up projections as one GEMM over one fused matrix "
                            "(same bytes, same bits); all: q, k and v as one GEMM too (labelled: may round "
                            "differently); off: separate GEMMs"),
    "--round-tokens": ("round_tokens", at_least(1), None,
                       "tokens a scheduler round puts through the model before Fast-dLLM cache fills run in "
                       "slices of layers beside the other requests' steps (chunked joining; the same tokens; "
                       "mosaic serve: 8192 unless given; default: fills run whole)"),
    "--cuda-graphs": ("cuda_graphs", None, ("auto", "off"),
                      "replay each planned step as a captured CUDA graph (auto: on a GPU, under a budget where "
                      "its graphs fit, sampled requests too; the same tokens as eager)"),
}


def add_engine_args(parser) -> argparse._ArgumentGroup:
    """--config FILE, --native and ENGINE_FLAGS, every one unset by default (module docstring)."""
    e = parser.add_argument_group("engine")
    e.add_argument("--config", metavar="ENGINE.yaml",
                   help="engine options from a YAML file (docs/CONFIG.md); flags given here override it")
    e.add_argument("--native", action="store_true", default=None,
                   help="run the published forward and sampler (the baseline)")
    for flag, (name, kind, choices, text) in ENGINE_FLAGS.items():
        default = _ENGINE_DEFAULTS[name]
        if kind == "flag":    # an on/off engine option: given means True
            e.add_argument(flag, dest=name, action="store_true", default=None, help=text)
            continue
        shown = f" (default: {default})" if default is not None and "default" not in text else ""
        e.add_argument(flag, dest=name, type=kind, choices=choices, default=None, help=text + shown,
                       metavar=None if choices else _metavar(flag))
    return e


def _metavar(flag: str) -> str:
    return flag.lstrip("-").upper().replace("-", "_")


def engine_config_from_args(args, **fixed) -> EngineConfig:
    """EngineConfig from --config FILE (if given), then every engine flag given on the command
    line, then `fixed` (the command's own settings, e.g. progress=False). InputError /
    ConfigFileError for a bad file or value."""
    names = [n for n, *_ in ENGINE_FLAGS.values()] + ["native"]
    given = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None} | \
        {k: v for k, v in fixed.items() if v is not None}
    if getattr(args, "config", None):
        return load_engine_config(args.config, **given)
    return EngineConfig(**given)


def engine_options_advice(options: dict) -> str:
    """How to pass the EngineConfig fields among `options` (generate()'s keyword arguments, e.g.
    batch_invariant=True, which are engine options, not generation options): as MosaicEngine's
    dict and as `mosaic generate` flags (--config FILE for a field without a flag); "" for none."""
    names = [n for n in options if n in _ENGINE_DEFAULTS]
    if not names:
        return ""
    flags = {name: (flag, kind) for flag, (name, kind, *_) in ENGINE_FLAGS.items()} | {"native": ("--native", "flag")}
    shown = {n: f'"{v}"' if isinstance(v, str) else repr(v) for n, v in options.items()}
    as_dict = ", ".join(f'"{n}": {shown[n]}' for n in names)
    cli = []
    for n in names:
        flag, kind = flags.get(n, ("--config ENGINE.yaml", "flag"))
        cli.append(flag if kind == "flag" else f"{flag} {options[n]}")
    what = f"{names[0]} is an engine option, not a generation option: pass it" if len(names) == 1 else \
        f"{', '.join(names)} are engine options, not generation options: pass them"
    return (f"{what} to the engine, MosaicEngine(model, {{{as_dict}}}), "
            f"or on the command line, `mosaic generate {' '.join(dict.fromkeys(cli))}`")
