"""Synthetic long-context tasks of the bundled long-context model (tiny-long): checkable answers.

Every prompt is exactly `length` tokens long with the BOS (one character = one token), and the
answer is ANSWER_LEN tokens: its characters, then end-of-text tokens (as in LLaDA's SFT data).

  kv    key-value retrieval from a dense list of records, the needle at a uniform depth:
        "..abc=4821;qxz=0937;...;mfe=5512;?qxz="  -> "0937"
  niah  needles in a haystack: NEEDLES records scattered through random filler text, one asked:
        "kdo wpe abc=4821;hq zjw...mfe=5512;ow e?abc="  -> "4821"
  copy  copy the SPAN_LEN characters after the start marker '#', found once in random text:
        "x3kq0...p7w2#hd81mz0q...ke9|#"  -> "hd81mz0q"

All three are attention lookups (find the anchor, read the characters after it), so a small
masked-diffusion transformer learns them from scratch: answer slot j sits as far after the
query's '=' or '#' as the character it must read sits after the needle's, like an induction
pattern. `solve` reads the answer off the prompt alone.

held_out(task, length) is the evaluation set of one cell: seeded apart from training, needle
depths evenly spread; tools/train_long.py never trains on a prompt in it (see held_out_digests).
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import defaultdict
from dataclasses import dataclass

ANSWER_LEN = 8
LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"
MARK = "#"                            # copy: the start marker, once in the text
CHARS = LETTERS + DIGITS + "=;?|. " + MARK
SPECIALS = ("<|bos|>", "<|eos|>", "<|mask|>", "<|eot|>")
TASKS = ("kv", "niah", "copy")
LENGTHS = (4096, 8192, 16384)         # evaluated context lengths (prompt tokens, BOS included)
KEY_LEN, VALUE_LEN = 3, 4             # kv / niah: "abc=4821;"
SPAN_LEN = 8                          # copy: characters copied after the marker
NEEDLES = 8                           # niah: records hidden in the filler
HELD_OUT_SEED = 20250101
MIN_LENGTH = 64


@dataclass(frozen=True)
class Example:
    task: str
    length: int      # prompt tokens with the BOS
    prompt: str      # length - 1 characters (the tokenizer adds the BOS)
    answer: str      # expected text; the model writes it then end-of-text up to ANSWER_LEN
    depth: float     # where the answer sits in the context: 0 = start, 1 = end


def vocab() -> dict[str, int]:
    return {tok: i for i, tok in enumerate(list(CHARS) + list(SPECIALS))}


def answer_ids(answer: str, voc: dict[str, int]) -> list[int]:
    """The ANSWER_LEN target tokens: the answer's characters, then end-of-text."""
    return [voc[c] for c in answer] + [voc["<|eos|>"]] * (ANSWER_LEN - len(answer))


def _pick(rng: random.Random, n: int, depth: float | None) -> int:
    """Index in [0, n): at `depth` (0..1) if given, else uniform."""
    if depth is None:
        return rng.randrange(n)
    return min(n - 1, max(0, int(depth * n)))


def _keys(rng: random.Random, n: int) -> list[str]:
    codes = rng.sample(range(len(LETTERS) ** KEY_LEN), n)
    out = []
    for c in codes:
        s = ""
        for _ in range(KEY_LEN):
            c, r = divmod(c, len(LETTERS))
            s += LETTERS[r]
        out.append(s)
    return out


def _kv(rng: random.Random, length: int, depth: float | None) -> Example:
    rec = KEY_LEN + VALUE_LEN + 2
    room = length - 1 - (KEY_LEN + 2)                # "?abc=" closes the prompt
    n = room // rec
    keys = _keys(rng, n)
    values = ["".join(rng.choices(DIGITS, k=VALUE_LEN)) for _ in range(n)]
    i = _pick(rng, n, depth)
    body = "".join(f"{k}={v};" for k, v in zip(keys, values))
    prompt = "." * (room - n * rec) + body + f"?{keys[i]}="
    return Example("kv", length, prompt, values[i], (i + 0.5) / n)


def _niah(rng: random.Random, length: int, depth: float | None) -> Example:
    rec = KEY_LEN + VALUE_LEN + 2
    room = length - 1 - (KEY_LEN + 2)
    k = max(1, min(NEEDLES, room // (4 * rec)))
    filler = rng.choices(LETTERS + " ", k=room - k * rec)
    keys = _keys(rng, k)
    values = ["".join(rng.choices(DIGITS, k=VALUE_LEN)) for _ in range(k)]
    cuts = sorted(rng.sample(range(len(filler) + 1), k))  # needle j goes before filler[cuts[j]]
    if depth is not None:  # the asked needle at that depth, the others anywhere
        target = min(len(filler), int(depth * len(filler)))
        if target not in cuts:
            cuts[rng.randrange(k)] = target
        cuts.sort()
        i = cuts.index(target)
    else:
        i = rng.randrange(k)
    parts, last = [], 0
    for j, c in enumerate(cuts):
        parts.append("".join(filler[last:c]))
        parts.append(f"{keys[j]}={values[j]};")
        last = c
    parts.append("".join(filler[last:]))
    hay = "".join(parts)
    at = hay.index(f"{keys[i]}=")
    return Example("niah", length, hay + f"?{keys[i]}=", values[i], at / len(hay))


def _copy(rng: random.Random, length: int, depth: float | None) -> Example:
    room = length - 1 - 2                            # "|#" closes the prompt
    text = rng.choices(LETTERS + DIGITS, k=room)
    p = _pick(rng, room - SPAN_LEN, depth)           # the marker; SPAN_LEN characters follow it
    text[p] = MARK
    text = "".join(text)
    return Example("copy", length, text + "|" + MARK, text[p + 1:p + 1 + SPAN_LEN], p / (room - SPAN_LEN - 1))


_MAKERS = {"kv": _kv, "niah": _niah, "copy": _copy}


def sample(rng: random.Random, task: str, length: int, depth: float | None = None) -> Example:
    """One example of `task` whose prompt is `length` tokens with the BOS; the needle at
    `depth` in [0, 1] if given, else at a uniform depth."""
    if task not in _MAKERS:
        raise ValueError(f"unknown task {task!r}; tasks: {TASKS}")
    if length < MIN_LENGTH:
        raise ValueError(f"length {length} < {MIN_LENGTH}")
    ex = _MAKERS[task](rng, length, depth)
    assert len(ex.prompt) == length - 1, (task, length, len(ex.prompt))
    return ex


def solve(prompt: str) -> str:
    """The answer, read off the prompt alone (checks the generators)."""
    if prompt.endswith("=") and prompt[-KEY_LEN - 2] == "?":
        key = prompt[-KEY_LEN - 1:-1]
        hay = prompt[:-KEY_LEN - 2]
        at = hay.index(key + "=") + KEY_LEN + 1
        return hay[at:at + VALUE_LEN]
    if prompt.endswith("|" + MARK):
        hay = prompt[:-2]
        at = hay.index(MARK) + 1
        return hay[at:at + SPAN_LEN]
    raise ValueError("not a prompt of these tasks")


def score(expected: str, got: str) -> dict[str, float]:
    """exact: the whole answer (ending where the model wrote end-of-text); chars: the share of
    answer characters right in place (partial credit, finer for comparing lossy options)."""
    right = sum(a == b for a, b in zip(expected, got))
    return {"exact": float(got == expected), "chars": right / len(expected)}


def held_out(task: str, length: int, n: int = 100, seed: int = HELD_OUT_SEED) -> list[Example]:
    """The evaluation set of one (task, length) cell; needle depths (i + 0.5) / n."""
    rng = random.Random(f"{seed}/{task}/{length}")
    return [sample(rng, task, length, (i + 0.5) / n) for i in range(n)]


def digest(prompt: str) -> bytes:
    return hashlib.blake2b(prompt.encode(), digest_size=12).digest()


def held_out_digests(task: str, length: int, n: int = 100) -> set[bytes]:
    return {digest(e.prompt) for e in held_out(task, length, n)}


def evaluate(engine, tasks=TASKS, lengths=LENGTHS, n: int = 100, batch_tokens: int = 262144,
             deadline: float | None = None, on_cell=None, depth_bins: int = 5, **gen) -> dict:
    """Held-out accuracy through a MosaicEngine: {"cells": [...]} with one record per (task,
    length): exact and per-character accuracy, n, seconds, exact accuracy per depth bin and a
    few wrong answers. Prompts of a cell have one length, so a batch needs no padding.
    deadline (time.monotonic()): stop early, marking the cell partial. on_cell(result) after
    each cell (to write partial results). gen: extra generation options."""
    gen = {"max_new_tokens": ANSWER_LEN, "steps": ANSWER_LEN} | gen
    cells = []
    out = {"cells": cells, "generation": gen}
    for length in lengths:
        for task in tasks:
            exs = held_out(task, length, n)
            bsz = max(1, batch_tokens // (length + ANSWER_LEN))
            tot = defaultdict(float)
            bins_right, bins_n = [0] * depth_bins, [0] * depth_bins
            wrong, done, partial = [], 0, False
            t0 = time.perf_counter()
            for s in range(0, len(exs), bsz):
                if deadline is not None and time.monotonic() > deadline:
                    partial = True
                    break
                chunk = exs[s:s + bsz]
                res = engine.generate([e.prompt for e in chunk], **gen)
                for e, text in zip(chunk, res.texts):
                    sc = score(e.answer, text)
                    for k, v in sc.items():
                        tot[k] += v
                    b = min(depth_bins - 1, int(e.depth * depth_bins))
                    bins_n[b] += 1
                    bins_right[b] += int(sc["exact"])
                    if not sc["exact"] and len(wrong) < 5:
                        wrong.append({"expected": e.answer, "got": text, "depth": round(e.depth, 3)})
                done += len(chunk)
            cell = {"task": task, "length": length, "n": done,
                    "exact": tot["exact"] / done if done else None,
                    "chars": tot["chars"] / done if done else None,
                    "seconds": round(time.perf_counter() - t0, 2),
                    "exact_by_depth": [r / c if c else None for r, c in zip(bins_right, bins_n)],
                    "wrong_examples": wrong}
            if partial:
                cell["partial"] = True
            cells.append(cell)
            if on_cell:
                on_cell(out)
    return out


def table(result: dict) -> str:
    """Exact-answer accuracy, one row per task, one column per length."""
    cells = result["cells"]
    lengths = sorted({c["length"] for c in cells})
    tasks = list(dict.fromkeys(c["task"] for c in cells))
    by = {(c["task"], c["length"]): c for c in cells}
    lines = [f"{'task':<6}" + "".join(f"{f'{L // 1024}k' if L % 1024 == 0 else L:>14}" for L in lengths)]
    for t in tasks:
        row = f"{t:<6}"
        for L in lengths:
            c = by.get((t, L))
            if c is None or c["exact"] is None:
                row += f"{'-':>14}"
            else:
                row += f"{c['exact']:>8.1%} n={c['n']:<3}"
        lines.append(row)
    return "\n".join(lines)
