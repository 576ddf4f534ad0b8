"""argparse value types shared by `mosaic generate | plan` (cli_args.py) and `mosaic serve | chat |
bench` (serve/commands.py): a bad value is one `error:` line from argparse, never a traceback."""

from __future__ import annotations

import argparse


def at_least(low: int):
    """An argparse type: a whole number >= low."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}" if low == 0 else
                                             f"must be at least {low}, got {n}")
        return n
    return parse


def number_in(ok, rule: str):
    """An argparse type: a number for which ok(value) holds; else "must be {rule}, got value"."""
    def parse(text: str) -> float:
        try:
            f = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not ok(f):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {f}")
        return f
    return parse
