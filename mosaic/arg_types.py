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
