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


def _draw_distinct(rng: np.random.Generator, B: int, n: int, k: int) -> np.ndarray:
    """[B, k] int64: k distinct integers of [0, n) per row, in random order."""
    if k * k > n:                       # a shuffle; else drawing again rows with a repeat is cheaper
        return np.argsort(rng.random((B, n)), axis=1)[:, :k]
    out = rng.integers(n, size=(B, k))
    while True:
        s = np.sort(out, 1)
        again = np.flatnonzero((s[:, 1:] == s[:, :-1]).any(1))
        if len(again) == 0:
            return out
        out[again] = rng.integers(n, size=(len(again), k))


def _queries(keys: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """The closing queries of B rows: keys [B, q] (the last one is asked), vals [B, q - 1,
    VALUE_LEN] the earlier ones' answers. Returns ids [B, (q - 1) * ASK + 2] ("? key value..."
    per answered query, then "? key") and the columns of the answered values."""
    B, q = keys.shape
    tail = np.empty((B, (q - 1) * ASK + 2), np.int64)
    sup = []
    for j in range(q - 1):
        c = j * ASK
        tail[:, c], tail[:, c + 1] = QUERY, K0 + keys[:, j]
        tail[:, c + 2:c + ASK] = V0 + vals[:, j]
        sup += range(c + 2, c + ASK)
    tail[:, -2], tail[:, -1] = QUERY, K0 + keys[:, -1]
    return tail, sup


def _answers(words: np.ndarray) -> np.ndarray:
    """[B, ANSWER_LEN]: the answer words [B, w], then end-of-text."""
    return np.concatenate([words, np.full((len(words), ANSWER_LEN - words.shape[1]), EOS)], 1)


def _kv(rng, length: int, B: int, depth, queries: int):
    room = length - 1 - 2                               # "? key" closes the prompt
    while queries > 1 and (room - (queries - 1) * ASK) // REC < queries:
        queries -= 1
    room -= (queries - 1) * ASK
    n = room // REC
    rows = np.arange(B)[:, None]
    asked = _draw_distinct(rng, B, n, queries)          # record indices; the last one is the answer
    if depth is not None:
        i = min(n - 1, max(0, int(depth * n)))
        asked[asked == i] = asked[:, -1:].repeat(queries, 1)[asked == i]
        asked[:, -1] = i
    uniq = _draw_distinct(rng, B, NUM_KEYS, queries)    # the asked keys occur once
    keys = rng.integers(NUM_KEYS - queries, size=(B, n))  # the others: any other key
    for t in np.sort(uniq, 1).T:                        # [0, N - q) -> [0, N) minus uniq, in order
        keys += keys >= t[:, None]
    keys[rows, asked] = uniq
    vals = rng.integers(NUM_VALUES, size=(B, n, VALUE_LEN))
    body = np.concatenate([K0 + keys[..., None], V0 + vals], 2).reshape(B, -1)
    tail, sup = _queries(uniq, vals[rows, asked[:, :-1]])
    ids = np.concatenate([np.full((B, room - n * REC), PAD), body, tail], 1)
    depths = (asked[:, -1] + 0.5) / n
    return ids, _answers(V0 + vals[np.arange(B), asked[:, -1]]), depths, np.array(sup, np.int64) + room


def _niah(rng, length: int, B: int, depth, queries: int):
    room = length - 1 - 2
    k = max(1, min(NEEDLES, room // (4 * REC)))
    queries = min(queries, k)
    room -= (queries - 1) * ASK                         # still >= k * REC: k <= room / (4 REC)
    m = room - k * REC                                  # filler words
    if depth is None:
        cuts = np.sort(_draw_distinct(rng, B, m + 1, k), 1)  # needle j goes before filler[cuts[j]]
        i = rng.integers(k, size=B)
    else:  # the asked needle at that depth, the others anywhere
        target = min(m, int(depth * m))
        others = _draw_distinct(rng, B, m, k - 1)
        others += others >= target
        cuts = np.sort(np.concatenate([others, np.full((B, 1), target)], 1), 1)
        i = np.argmax(cuts == target, 1)
    starts = cuts + np.arange(k) * REC                  # needle j's key in the haystack
    keys = _draw_distinct(rng, B, NUM_KEYS, k)
    vals = rng.integers(NUM_VALUES, size=(B, k, VALUE_LEN))
    hay = np.empty((B, room), np.int64)
    is_needle = np.zeros((B, room), bool)
    pos = (starts[..., None] + np.arange(REC)).reshape(B, -1)
    is_needle[np.arange(B)[:, None], pos] = True        # row-major order = needle j, word r
    hay[is_needle] = np.concatenate([K0 + keys[..., None], V0 + vals], 2).reshape(-1)
    hay[~is_needle] = W0 + rng.integers(NUM_WORDS, size=B * m)
    rows = np.arange(B)[:, None]
    order = np.argsort(rng.random((B, k)) + (np.arange(k) == i[:, None]), 1)  # the asked needle last
    asked = order[:, k - queries:]
    tail, sup = _queries(keys[rows, asked], vals[rows, asked[:, :-1]])
    ids = np.concatenate([hay, tail], 1)
    depths = starts[np.arange(B), i] / room
    return ids, _answers(V0 + vals[np.arange(B), i]), depths, np.array(sup, np.int64) + room


def _copy(rng, length: int, B: int, depth, queries: int):
    room = length - 1 - 2                               # "| #" closes the prompt
    words = W0 + rng.integers(NUM_WORDS, size=(B, room))
    if depth is None:
        p = rng.integers(room - SPAN_LEN, size=B)       # the marker; SPAN_LEN words follow it
    else:
        p = np.full(B, min(room - SPAN_LEN - 1, max(0, int(depth * (room - SPAN_LEN)))))
    rows = np.arange(B)
    words[rows, p] = MARK
    span = words[rows[:, None], p[:, None] + 1 + np.arange(SPAN_LEN)]
    ids = np.concatenate([words, np.full((B, 1), BAR), np.full((B, 1), MARK)], 1)
    return ids, _answers(span), p / max(1, room - SPAN_LEN - 1), np.zeros(0, np.int64)


_MAKERS = {"kv": _kv, "niah": _niah, "copy": _copy}


def batch(rng: np.random.Generator, task: str, length: int, B: int, queries: int = 1,
          depth: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """B examples of `task` at once (vectorised, for training): prompts ids [B, length - 1] (no
    BOS), answers [B, ANSWER_LEN], depths [B], and the columns of ids holding answered values
    (queries > 1: kv and niah close with up to that many queries, the earlier ones answered;
    the same columns in every row). depth in [0, 1]: the needle there in every row, else
    uniform."""
    if task not in _MAKERS:
        raise ValueError(f"unknown task {task!r}; tasks: {TASKS}")
    if length < MIN_LENGTH:
        raise ValueError(f"length {length} < {MIN_LENGTH}")
    ids, ans, depths, sup = _MAKERS[task](rng, length, B, depth, max(1, queries))
    assert ids.shape == (B, length - 1), (task, length, ids.shape)
    return ids.astype(np.int64), ans.astype(np.int64), depths, sup


def sample(rng: np.random.Generator, task: str, length: int, depth: float | None = None,
           queries: int = 1) -> Example:
    """One example of `task` whose prompt is `length` tokens with the BOS; the needle at
    `depth` in [0, 1] if given, else at a uniform depth. queries > 1 (kv, niah; training only):
    up to that many queries, the earlier ones answered (Example.supervised)."""
    ids, ans, depths, sup = batch(rng, task, length, 1, queries, depth)
    return Example(task, length, ids[0], ans[0], float(depths[0]), sup)


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
