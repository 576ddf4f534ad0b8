"""`mosaic chat`: a multi-turn chat in the terminal through the model's chat template.

Each turn encodes the whole history (system prompt, earlier turns, the new message) with the
template, shows the context it uses against the longest request the budget admits, and streams
the committed text as the denoising steps go (the generated prefix up to the first still-masked
position: final once unmasked). Lines starting with '/' are commands: /reset, /exit."""

from __future__ import annotations

import sys
import time

from ..config import GenerationConfig
from ..engine import MosaicEngine
from ..errors import MosaicError, gib
from .canvas_reader import CanvasReader
from .capacity import capacity_tokens
from .stream import CommittedText, eos_ids

HELP = "commands: /reset (forget the history), /exit (or end of input)"


def run_chat(engine: MosaicEngine, gen: GenerationConfig, system: str | None = None, stream: bool = True,  # noqa: C901
             stdin=None, out=None, err=None) -> int:
    """Read user turns from stdin until end of input or /exit; answers go to `out`, status
    lines (context used / capacity, steps, seconds) to `err`. Returns the exit code (0)."""
    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    if engine.model.tokenizer is None:
        raise MosaicError(f"model {engine.model.name} has no tokenizer: mosaic chat needs one (tokenizer.json)")
    cap = capacity_tokens(engine, gen)
    start = [{"role": "system", "content": system}] if system else []
    if start:   # checked once, before the first turn: a bad system prompt would fail every turn
        try:
            engine.encode(start, chat=True)
        except MosaicError as e:
            raise MosaicError(f"--system: {e}") from None
    history = list(start)
    tty = hasattr(stdin, "isatty") and stdin.isatty()
    budget = engine.budget.budget_bytes
    print(f"mosaic chat · {engine.model.name} on {engine.model.device} · budget "
          f"{gib(budget) if budget else 'none'} · capacity {f'{cap:,} tokens' if cap else 'unbounded'} · {HELP}",
          file=err, flush=True)
    while True:
        if tty:
            print("you> ", end="", file=out, flush=True)
        line = stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() in ("/exit", "/quit"):
            break
        if text.strip() == "/reset":
            history = list(start)
            print("(history cleared)", file=err, flush=True)
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]}; {HELP}", file=err, flush=True)
            continue
        turn = history + [{"role": "user", "content": text}]
        try:
            answer = _answer(engine, gen, turn, cap, stream, out, err)
        except KeyboardInterrupt:
            print("\n(interrupted; the turn is dropped)", file=err, flush=True)
            continue
        except MosaicError as e:
            print(f"error: {e}", file=err, flush=True)
            continue
        history = turn + [{"role": "assistant", "content": answer}]
    return 0


def _answer(engine, gen, messages, cap, stream, out, err) -> str:
    ids = engine.encode(messages, chat=True)[0]
    used = len(ids) + gen.max_new_tokens
    if cap and used > cap:
        raise MosaicError(f"the context is full: {len(ids):,} tokens of history + {gen.max_new_tokens} to generate "
                          f"= {used:,} > capacity {cap:,}; /reset to start again")
    print(f"[context {used:,} / {f'{cap:,}' if cap else 'unbounded'} tokens]", file=err, flush=True)
    cfg = engine.model.cfg
    text = CommittedText(engine.decode, eos_ids(cfg), cfg.mask_id)
    P = len(ids)
    shown = [False]

    def show(delta: str) -> None:
        if not shown[0]:
            print("mosaic> ", end="", file=out)
            shown[0] = True
        print(delta, end="", file=out, flush=True)

    reader = CanvasReader(P)          # on CUDA one step late, without stalling the device

    def follow(gen_ids) -> bool:
        masked = int((gen_ids == cfg.mask_id).sum())
        delta = text.update(gen_ids, final=masked == 0)
        if stream and delta:
            show(delta)
        return bool(text.done and masked)   # the committed prefix ends the answer: stop here

    def on_step(i, canvas):
        got = reader.push(i, canvas)
        return False if got is None else follow(got[1])
    t0 = time.perf_counter()
    engine.generate([ids], config=gen, on_step=on_step, progress=False)
    if (got := reader.flush()) is not None:
        follow(got[1])
    if not stream or not shown[0]:
        show(text.text)
    print(file=out, flush=True)
    print(f"[{time.perf_counter() - t0:.2f} s]", file=err, flush=True)
    return text.text
