"""Synthetic long-context tasks of the bundled long-context model (tiny-long): checkable answers.

Word-level: every token is one word of a fixed vocabulary (keys k0..k511, values v0..v255,
filler words w0..w511, a few markers), written with single spaces, so a prompt of `length`
tokens is length - 1 words (the tokenizer adds the BOS). The answer is ANSWER_LEN tokens: its
words, then end-of-text tokens (as in LLaDA's SFT data).

  kv    key-value retrieval from a dense list of records "key value value", the asked key once:
        "k17 v3 v250 k402 v9 v91 ... k88 v1 v77 ? k402"             -> "v9 v91"
  niah  NEEDLES records hidden in filler words (the only key words of the text), one asked:
        "w5 w311 k17 v3 v250 w77 ... w9 ? k17"                      -> "v3 v250"
  copy  copy the SPAN_LEN words after the marker '#', found once in filler words:
        "w5 w311 # w7 w8 w9 w10 w77 ... w2 | #"                     -> "w7 w8 w9 w10"

Why words and not characters: the first design (one character a token, 3-letter keys, 4-digit
values) was never learnt (tools/train_long.py, 5,609 steps on an H200: answer characters at
chance). A key of several tokens must be assembled by several position-exact attention heads
before it can be matched, and a masked-diffusion model predicts every answer slot at once, with
no earlier answer token to lean on. One-token keys need one previous-token head and one matching
head (the two-layer induction circuit), which small models learn.

sample(..., queries=q) is for training only: the prompt then ends with q - 1 more answered
queries "? key value value" before the asked one, each a retrieval whose values the trainer
masks too (q times the supervision of a row; the held-out prompts have one query).

held_out(task, length) is the evaluation set of one cell: seeded apart from training, needle
depths evenly spread; tools/train_long.py never trains on a prompt in it (see held_out_digests).
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

ANSWER_LEN = 8
NUM_KEYS, NUM_VALUES, NUM_WORDS = 512, 256, 512
VALUE_LEN = 2                         # kv / niah: words of a value
SPAN_LEN = 4                          # copy: words copied after the marker
NEEDLES = 8                           # niah: records hidden in the filler
SPECIALS = ("<|bos|>", "<|eos|>", "<|mask|>", "<|eot|>")
MARKS = ("?", "#", "|", ".")          # query, copy marker, copy query, kv padding
KEYS = tuple(f"k{i}" for i in range(NUM_KEYS))
VALUES = tuple(f"v{i}" for i in range(NUM_VALUES))
FILLER = tuple(f"w{i}" for i in range(NUM_WORDS))
WORDS = SPECIALS + MARKS + KEYS + VALUES + FILLER          # token id = index
TASKS = ("kv", "niah", "copy")
LENGTHS = (4096, 8192, 16384)         # evaluated context lengths (prompt tokens, BOS included)
HELD_OUT_SEED = 20250101
MIN_LENGTH = 16

BOS, EOS, MASK, EOT = range(4)
QUERY, MARK, BAR, PAD = range(4, 8)
K0 = len(SPECIALS) + len(MARKS)       # first key id
V0 = K0 + NUM_KEYS                    # first value id
W0 = V0 + NUM_VALUES                  # first filler id
REC = 1 + VALUE_LEN                   # a record: key, value words
ASK = 2 + VALUE_LEN                   # an answered query: "?", key, value words


@dataclass(frozen=True, eq=False)
class Example:
    task: str
    length: int          # prompt tokens with the BOS
    ids: np.ndarray      # [length - 1] int64 prompt token ids (no BOS)
    answer_ids: np.ndarray  # [ANSWER_LEN] int64: the answer's tokens, then end-of-text
    depth: float         # where the answer sits in the context: 0 = start, 1 = end
    supervised: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """positions in `ids` of the earlier queries' value tokens (training: queries > 1)"""

    @property
    def prompt(self) -> str:
        return text(self.ids)

    @property
    def answer(self) -> str:
        return text(self.answer_ids[self.answer_ids != EOS])

    def __eq__(self, other) -> bool:
        return (isinstance(other, Example) and self.task == other.task and self.length == other.length
                and np.array_equal(self.ids, other.ids) and np.array_equal(self.answer_ids, other.answer_ids))


def vocab() -> dict[str, int]:
    return {w: i for i, w in enumerate(WORDS)}


def text(ids) -> str:
    return " ".join(WORDS[int(i)] for i in ids)


def encode(prompt: str) -> np.ndarray:
    """Prompt words -> token ids (no BOS); the inverse of text()."""
    voc = vocab()
    return np.array([voc[w] for w in prompt.split(" ")], dtype=np.int64)


def answer_ids(answer: str) -> np.ndarray:
    """The ANSWER_LEN target tokens: the answer's words, then end-of-text."""
    ids = encode(answer) if answer else np.zeros(0, np.int64)
    return np.concatenate([ids, np.full(ANSWER_LEN - len(ids), EOS, np.int64)])


def _at(rng: np.random.Generator, n: int, depth: float | None) -> int:
    """Index in [0, n): at `depth` (0..1) if given, else uniform."""
    if depth is None:
        return int(rng.integers(n))
    return min(n - 1, max(0, int(depth * n)))


def _queries(asked_keys, values, last_key) -> tuple[list[int], list[int]]:
    """Token ids of the answered queries then "? last_key", and the positions of their values."""
    out, sup = [], []
    for k, v in zip(asked_keys, values):
        out += [QUERY, K0 + k]
        sup += range(len(out), len(out) + VALUE_LEN)
        out += [V0 + x for x in v]
    return out + [QUERY, K0 + last_key], sup


def _fit_queries(room: int, per_query_records: int, queries: int) -> int:
    """How many queries fit (at least one): each needs ASK tokens and records to ask about."""
    while queries > 1 and (room - (queries - 1) * ASK) // REC < queries * per_query_records:
        queries -= 1
    return queries


def _kv(rng, length: int, depth, queries: int) -> Example:
    room = length - 1 - 2                               # "? key" closes the prompt
    queries = _fit_queries(room, 1, queries)
    room -= (queries - 1) * ASK
    n = room // REC
    asked = rng.choice(n, queries, replace=False)       # record indices; the last one is the answer
    i = _at(rng, n, depth)
    if i in asked[:-1]:
        asked[asked == i] = asked[-1]
    asked[-1] = i
    uniq = rng.choice(NUM_KEYS, queries, replace=False)  # the asked keys occur once
    keys = _skip(rng.integers(NUM_KEYS - queries, size=n), np.sort(uniq))  # the others: any other key
    keys[asked] = uniq
    vals = rng.integers(NUM_VALUES, size=(n, VALUE_LEN))
    body = np.concatenate([K0 + keys[:, None], V0 + vals], 1).reshape(-1)
    tail, sup = _queries(keys[asked[:-1]], vals[asked[:-1]], keys[i])
    ids = np.concatenate([np.full(room - n * REC, PAD), body, tail]).astype(np.int64)
    start = room
    return Example("kv", length, ids, _answer(vals[i]), (i + 0.5) / n, np.array(sup, np.int64) + start)


def _skip(draws: np.ndarray, taken: np.ndarray) -> np.ndarray:
    """Map draws from [0, N - len(taken)) onto [0, N) minus `taken` (sorted), keeping order."""
    out = draws.copy()
    for t in taken:          # few taken values: shift past each in turn
        out[out >= t] += 1
    return out


def _answer(vals) -> np.ndarray:
    return np.concatenate([V0 + np.asarray(vals, np.int64), np.full(ANSWER_LEN - VALUE_LEN, EOS, np.int64)])


def _niah(rng, length: int, depth, queries: int) -> Example:
    room = length - 1 - 2
    k = max(1, min(NEEDLES, room // (4 * REC)))
    queries = min(queries, k)
    room -= (queries - 1) * ASK                         # still >= k * REC: k <= room / (4 REC)
    filler = W0 + rng.integers(NUM_WORDS, size=room - k * REC)
    keys = rng.choice(NUM_KEYS, k, replace=False)
    vals = rng.integers(NUM_VALUES, size=(k, VALUE_LEN))
    cuts = np.sort(rng.choice(len(filler) + 1, k, replace=False))  # needle j goes before filler[cuts[j]]
    if depth is not None:  # the asked needle at that depth, the others anywhere
        target = min(len(filler), int(depth * len(filler)))
        if target not in cuts:
            cuts[rng.integers(k)] = target
            cuts.sort()
        i = int(np.searchsorted(cuts, target))
    else:
        i = int(rng.integers(k))
    parts, last, at = [], 0, 0
    for j, c in enumerate(cuts):
        parts.append(filler[last:c])
        if j == i:
            at = sum(len(p) for p in parts)
        parts.append(np.concatenate([[K0 + keys[j]], V0 + vals[j]]))
        last = c
    parts.append(filler[last:])
    hay = np.concatenate(parts)
    others = [j for j in rng.permutation(k).tolist() if j != i][:queries - 1]
    tail, sup = _queries(keys[others], vals[others], keys[i])
    ids = np.concatenate([hay, tail]).astype(np.int64)
    return Example("niah", length, ids, _answer(vals[i]), at / len(hay), np.array(sup, np.int64) + len(hay))


def _copy(rng, length: int, depth, queries: int) -> Example:
    room = length - 1 - 2                               # "| #" closes the prompt
    words = W0 + rng.integers(NUM_WORDS, size=room)
    p = _at(rng, room - SPAN_LEN, depth)                # the marker; SPAN_LEN words follow it
    words[p] = MARK
    span = words[p + 1:p + 1 + SPAN_LEN]
    ids = np.concatenate([words, [BAR, MARK]]).astype(np.int64)
    ans = np.concatenate([span, np.full(ANSWER_LEN - SPAN_LEN, EOS)]).astype(np.int64)
    return Example("copy", length, ids, ans, p / max(1, room - SPAN_LEN - 1))


_MAKERS = {"kv": _kv, "niah": _niah, "copy": _copy}


def sample(rng: np.random.Generator, task: str, length: int, depth: float | None = None,
           queries: int = 1) -> Example:
    """One example of `task` whose prompt is `length` tokens with the BOS; the needle at
    `depth` in [0, 1] if given, else at a uniform depth. queries > 1 (kv, niah; training only):
    up to that many queries, the earlier ones answered (Example.supervised)."""
    if task not in _MAKERS:
        raise ValueError(f"unknown task {task!r}; tasks: {TASKS}")
    if length < MIN_LENGTH:
        raise ValueError(f"length {length} < {MIN_LENGTH}")
    ex = _MAKERS[task](rng, length, depth, max(1, queries))
    assert len(ex.ids) == length - 1, (task, length, len(ex.ids))
    return ex


def solve(prompt: str) -> str:
    """The answer, read off the prompt alone (checks the generators)."""
    w = prompt.split(" ")
    if len(w) >= 2 and w[-2] == "?":
        key = w[-1]
        at = w.index(key) + 1                      # the asked key occurs once before the query
        return " ".join(w[at:at + VALUE_LEN])
    if w[-2:] == ["|", "#"]:
        at = w.index("#") + 1
        return " ".join(w[at:at + SPAN_LEN])
    raise ValueError("not a prompt of these tasks")


def score(expected: str, got: str) -> dict[str, float]:
    """exact: the whole answer (ending where the model wrote end-of-text); tokens: the share of
    answer words right in place (partial credit, finer for comparing lossy options)."""
    e, g = expected.split(), got.split()
    right = sum(a == b for a, b in zip(e, g))
    return {"exact": float(got == expected), "tokens": right / len(e)}


def held_out(task: str, length: int, n: int = 100, seed: int = HELD_OUT_SEED) -> list[Example]:
    """The evaluation set of one (task, length) cell; needle depths (i + 0.5) / n."""
    rng = np.random.default_rng([seed, TASKS.index(task), length])
    return [sample(rng, task, length, (i + 0.5) / n) for i in range(n)]


def digest(ids: np.ndarray) -> bytes:
    return hashlib.blake2b(np.asarray(ids, np.int64).tobytes(), digest_size=12).digest()


def held_out_digests(task: str, length: int, n: int = 100) -> set[bytes]:
    return {digest(e.ids) for e in held_out(task, length, n)}


def evaluate(engine, tasks=TASKS, lengths=LENGTHS, n: int = 100, batch_tokens: int = 262144,
             deadline: float | None = None, on_cell=None, depth_bins: int = 5, **gen) -> dict:
    """Held-out accuracy through a MosaicEngine: {"cells": [...]} with one record per (task,
    length): exact and per-token accuracy, n, seconds, exact accuracy per depth bin and a few
    wrong answers. Prompts of a cell have one length, so a batch needs no padding.
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
                for e, got in zip(chunk, res.texts):
                    sc = score(e.answer, got)
                    for k, v in sc.items():
                        tot[k] += v
                    b = min(depth_bins - 1, int(e.depth * depth_bins))
                    bins_n[b] += 1
                    bins_right[b] += int(sc["exact"])
                    if not sc["exact"] and len(wrong) < 5:
                        wrong.append({"expected": e.answer, "got": got, "depth": round(e.depth, 3)})
                done += len(chunk)
            cell = {"task": task, "length": length, "n": done,
                    "exact": tot["exact"] / done if done else None,
                    "tokens": tot["tokens"] / done if done else None,
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
