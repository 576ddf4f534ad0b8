"""The synthetic tasks of the bundled tiny models: answers a person can check at a glance.

  "57+384="        -> "441"        (addition, operands of 2-3 digits)
  "sort 31415926=" -> "11234569"   (sort 3-8 digits)

The answer is followed by end-of-text tokens up to ANSWER_LEN, as in LLaDA's SFT data.
"""

from __future__ import annotations

import random

ANSWER_LEN = 8
CHARS = "0123456789+= sort"
SPECIALS = ("<|bos|>", "<|eos|>", "<|mask|>", "<|eot|>")


def vocab() -> dict[str, int]:
    chars = list(dict.fromkeys(CHARS))
    return {tok: i for i, tok in enumerate(chars + list(SPECIALS))}


def solve(prompt: str) -> str:
    body = prompt.rstrip("=")
    if body.startswith("sort "):
        return "".join(sorted(body[5:]))
    a, b = body.split("+")
    return str(int(a) + int(b))


def sample(rng: random.Random, kind: str, size: int) -> str:
    """kind 'add': size = digits of the larger operand (2-3); kind 'sort': digit count (3-8)."""
    if kind == "add":
        a = rng.randint(10 ** (size - 1), 10**size - 1)
        b = rng.randint(10, 10**size - 1)
        return f"{a}+{b}=" if rng.random() < 0.5 else f"{b}+{a}="
    return "sort " + "".join(rng.choice("0123456789") for _ in range(size)) + "="


def shapes() -> list[tuple[str, int]]:
    return [("add", 2), ("add", 3)] + [("sort", s) for s in range(3, 9)]


def held_out(per_shape: int = 100, seed: int = 12345) -> list[str]:
    """Prompts never shown in training (tools/train_tiny.py skips them)."""
    rng = random.Random(seed)
    out: list[str] = []
    for shape in shapes():
        seen: set[str] = set()
        while len(seen) < per_shape:
            seen.add(sample(rng, *shape))
        out += sorted(seen)
    return out
