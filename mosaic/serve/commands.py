"""The `serve`, `chat` and `bench` subcommands of the mosaic CLI (wired in by mosaic/cli.py)."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import math
import os
import socket

from ..arg_types import at_least
from ..cli_options import add_sampling_args, engine_config_from_args, sampling_options, writable_file
from ..config import EngineConfig, name_defaults
from ..engine import MosaicEngine
from ..errors import InputError, MosaicError
from ..loader import available_bytes, resolve_device
from .bench import PRESETS, bench_main
from .chat import run_chat

COMMANDS = ("serve", "chat", "bench")
# chunked joining's round budget for the server (--round-tokens): vLLM V1's max_num_batched_tokens for
# its OpenAI server on large GPUs. Every fill gets at least half of it a round, so fills of up to 4,096
# tokens (a 1k-prompt + 128 dual-cache refill: 1,152) run whole and stack with the others' fills; a
# longer prompt's fill rides along in slices. At 2,048 (a 1,024-token floor) the refills of 16 served
# requests ran as 100 slices of layers, each its own eager forward (H200: 45 ms a slice, 4.5 s of 8 s)
SERVE_ROUND_TOKENS = 8192
CHAT_OPTIONS = ("max_new_tokens", "steps", "block_length", "temperature", "seed")

SERVE_HELP = """OpenAI-compatible HTTP server: POST /v1/completions, POST /v1/chat/completions,
GET /v1/models[/ID], POST /tokenize, POST /detokenize, GET /health, GET /metrics (Prometheus),
GET /version, /ping. max_tokens is the canvas length: a
diffusion LLM denoises a fixed canvas of max_tokens positions and the answer ends at the first
end-of-text. Every request is admitted against a memory budget (default: what the device, or on
a CPU the host, has free at start): one that does not fit gets HTTP 400 context_length_exceeded
with the longest prompt + max_tokens that fits, before it is queued. --api-key (or MOSAIC_API_KEY)
requires `Authorization: Bearer KEY` on the API (/v1/*, /tokenize, /detokenize). Longer requests
than the model was trained for get 400 unless --max-model-len allows them. SIGINT / SIGTERM cancel the
running work and exit 0. Needs the `serve` extra: pip install 'mosaic-dllm[serve]'.
docs/SERVING.md has every field."""


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written; defaults shown where there is one."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def add_parsers(sub, engine_args) -> None:
    """Add the subcommands to the CLI's subparsers; engine_args(parser) adds the engine options."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the serve extra)",
                       description=SERVE_HELP, formatter_class=_Formatter)
    s.add_argument("--model", default="tiny-llada", help="checkpoint folder, bundled model or preset")
    s.add_argument("--host", type=_host, default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=_port, default=8000, help="port to listen on (0: a free port, logged at start)")
    s.add_argument("--served-model-name", type=_name, help="the model id clients send (default: the model's name)")
    s.add_argument("--max-queue", type=at_least(1), default=256, help="requests waiting before new ones get 503")
    s.add_argument("--max-model-len", type=at_least(1), default=None,
                   help="longest prompt + max_tokens accepted; longer requests get 400 (default: the length the "
                        "model was trained for, config.json's; above it answers may degrade)")
    s.add_argument("--max-batch", type=at_least(1), default=16,
                   help="sequences the continuous batch holds at once (1: one request at a time)")
    s.add_argument("--api-key", type=_key, default=None,
                   help="require 'Authorization: Bearer KEY' on the API: /v1/*, /tokenize, /detokenize "
                        "(default: $MOSAIC_API_KEY)")
    s.add_argument("--allowed-origins", type=_origins, default=(),
                   help="browser origins allowed to call the server (CORS): comma separated or a JSON list, '*' for "
                        "any (default: none, no CORS headers)")
    s.add_argument("--protect-metrics", action="store_true",
                   help="with an API key, /metrics needs it too (by default only the API does, as in vLLM)")
    s.add_argument("--request-timeout", type=_seconds(0, "more than 0"), default=None,
                   help="seconds after which a request is cancelled and answered 504 (default: none)")
    s.add_argument("--shutdown-timeout", type=_seconds(0, "0 or more", inclusive=True), default=60.0,
                   help="seconds SIGINT / SIGTERM wait for the step in flight before leaving")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    _shared(s, engine_args)

    c = sub.add_parser("chat", help="interactive multi-turn chat in the terminal", formatter_class=_Formatter,
                       description="Chat with the model's chat template; the history is kept, the context used "
                                   "is shown against the budget's capacity, answers stream as steps go. "
                                   "Commands: /reset, /exit.")
    c.add_argument("--model", default="tiny-llada", help="checkpoint folder with a tokenizer, or a bundled model")
    c.add_argument("--system", help="system prompt")
    add_sampling_args(c, only=CHAT_OPTIONS)
    c.add_argument("--no-stream", action="store_true", help="print each answer when it is complete")
    _shared(c, engine_args)

    b = sub.add_parser("bench", help="latency, throughput and capacity under a budget", formatter_class=_Formatter,
                       description="Latency (p50/p90 of single runs), throughput (one batch) and capacity "
                                   "(the longest prompt + output the budget admits) of a model. Presets: "
                                   + ", ".join(f"{k} ({v['model']})" for k, v in PRESETS.items()))
    b.add_argument("--preset", choices=sorted(PRESETS), help="a model and sizes; options given here override it")
    b.add_argument("--model", help="checkpoint folder, bundled model or preset (default: tiny-llada)")
    b.add_argument("--input-len", type=at_least(1), help="prompt tokens, seeded random ids (default 16)")
    b.add_argument("--output-len", type=at_least(1), help="canvas tokens, max_new_tokens (default 8)")
    add_sampling_args(b, only=("steps", "block_length"))
    b.add_argument("--batch-size", type=at_least(1), help="prompts in the throughput batch (default 1)")
    b.add_argument("--runs", type=at_least(1), help="measured latency runs (default 3)")
    b.add_argument("--warmup", type=at_least(0), help="runs before measuring (default 1)")
    b.add_argument("--seed", type=at_least(0), help="seed of the prompts and the sampler (default 0)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--out", type=writable_file, help="also write the JSON record to this file")
    _shared(b, engine_args)


def _port(text: str) -> int:
    """--port: 0 (uvicorn binds a free port and logs it) to 65535; argparse turns the
    ArgumentTypeError into one `error:` line and exit code 2."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is out of range: a port is 0-65535 (0: any free port)")
    return port


def _host(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: give an address such as 127.0.0.1 or 0.0.0.0")
    return text.strip()


def _name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: give the model id clients send, or leave the flag out")
    return text.strip()


def _key(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("empty: give the key clients must send as 'Authorization: Bearer KEY'")
    return text.strip()


def _origins(text: str) -> tuple[str, ...]:
    """--allowed-origins: 'https://a.example,https://b.example', a JSON list (vLLM's form) or '*'."""
    items = None
    if text.strip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list of origins ({e})") from None
    items = items if items is not None else [t.strip() for t in text.split(",") if t.strip()]
    if not items or not all(isinstance(o, str) and (o == "*" or "://" in o) for o in items):
        raise argparse.ArgumentTypeError(f"{text!r}: give origins such as https://app.example (scheme://host[:port]), "
                                         "comma separated or a JSON list, or '*' for any")
    return tuple(items)


def _seconds(low: float, what: str, inclusive: bool = False):
    """An argparse type: a finite number of seconds above `low` (or equal, when inclusive)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"must be {what} seconds, got {text}")
        return value
    return parse


def check_listen(host: str, port: int) -> None:
    """MosaicError unless the server can listen on host:port: the host resolves
    (socket.getaddrinfo) and a socket binds there the way uvicorn binds it (IPv6 for an address
    with ':', SO_REUSEADDR), then is closed. A check, not a reservation: another process may
    still take the port before the server binds it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    try:
        socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise MosaicError(f"--host {host!r} is not an address this machine can listen on ({e.strerror}); "
                          "give an address such as 127.0.0.1, 0.0.0.0 or ::1, or a host name that resolves") from None
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            hint = {errno.EADDRINUSE: "another process is listening there: pick another --port (0: any free port)",
                    errno.EADDRNOTAVAIL: "the address is not one of this machine's: give one it has, "
                                         "or 0.0.0.0 for all",
                    errno.EACCES: "ports below 1024 need privileges: pick a port of 1024 or more"}
            raise MosaicError(f"cannot listen on {where}: {e.strerror} ({hint.get(e.errno, 'see --host / --port')})"
                              ) from None


def default_budget(econf: EngineConfig) -> tuple[EngineConfig, str]:
    """The engine config with a budget, and where the budget came from. Without --budget (or a
    memory_budget in --config) the server admits against what is free at start, before the
    weights load: a CUDA device's free memory (cudaMemGetInfo, after this process's context is
    created, so the context is charged twice: conservative by its size), the host's MemAvailable
    on a CPU (or its cgroup limit's room: host_memory.py). A server never admits without a
    budget: nothing would refuse a request the machine cannot hold."""
    if econf.memory_budget is not None:
        return econf, "--budget / the engine config"
    dev = resolve_device(econf.device)
    free = available_bytes(dev)
    if not free:
        raise MosaicError(f"cannot tell the free memory of {dev}: give the server a budget with --budget")
    where = "free device memory at start" if dev.type == "cuda" else "free host memory at start (MemAvailable)"
    return dataclasses.replace(econf, memory_budget=int(free)), f"{where}; --budget sets it"


def _shared(p, engine_args) -> None:
    engine_args(p)
    p.add_argument("--max-seq-len", type=at_least(1),
                   help="longest prompt + output admitted (checked against the budget at start)")


def engine_config(args) -> EngineConfig:
    """EngineConfig from the engine flags (and --config FILE, which the flags given override)."""
    if getattr(args, "gpus", 1) > 1:
        raise MosaicError(f"mosaic {args.cmd} runs on one device (--gpus {args.gpus} is for mosaic generate)")
    return engine_config_from_args(args, progress=False, max_length=args.max_seq_len)


def run(args) -> int:
    """Run one of COMMANDS; MosaicError propagates to the CLI (error: ..., exit code 2)."""
    econf = engine_config(args)
    if args.cmd == "bench":
        return bench_main(args, econf)
    if args.cmd == "serve":
        check_listen(args.host, args.port)   # before the model loads: a bad address is one error line
        if args.max_model_len and args.max_seq_len and args.max_model_len > args.max_seq_len:
            raise MosaicError(f"--max-model-len {args.max_model_len} is more than --max-seq-len {args.max_seq_len}: "
                              f"give at most {args.max_seq_len}, or raise both")
        api_key = args.api_key or os.environ.get("MOSAIC_API_KEY", "").strip() or None
        econf, source = default_budget(econf)
        if econf.round_tokens is None:     # a server joins requests under load: fills ride along in slices
            econf = dataclasses.replace(econf, round_tokens=SERVE_ROUND_TOKENS)
    engine = MosaicEngine(args.model, econf)
    if args.cmd == "chat":
        options = sampling_options(args)
        gen = engine.generation_config(**options)
        try:
            engine.sampler.check(gen, 1)
        except InputError as e:   # a value no flag set is named as generation_config.json's
            raise InputError(name_defaults(str(e), options, engine.model.generation_defaults),
                             param=e.param) from None
        return run_chat(engine, gen, system=args.system, stream=not args.no_stream)
    try:
        from . import server  # needs the serve extra (fastapi, uvicorn, prometheus-client)
    except ImportError as e:
        raise MosaicError(f"mosaic serve needs the serve extra ({e.name} is missing): "
                          "pip install 'mosaic-dllm[serve]'") from None
    server.serve(engine, args.host, args.port, args.served_model_name, args.max_queue, args.log_level,
                 api_key=api_key, request_timeout=args.request_timeout, shutdown_timeout=args.shutdown_timeout,
                 budget_source=source, max_batch=args.max_batch, max_model_len=args.max_model_len,
                 allowed_origins=args.allowed_origins, protect_metrics=args.protect_metrics)
    return 0
