"""A constraint compiled against a model's vocabulary: a token-level DFA from outlines-core.

outlines-core (dottxt-ai/outlines-core, Apache-2.0; the `structured` extra) turns a JSON Schema
into a regex (`json_schema.build_regex_from_schema`, recursive references unrolled to a bounded
depth) and a regex into an `Index`: for every DFA state, the tokens allowed there and the state
each leads to. Mosaic reads that table once per constraint and derives what a fixed-length
diffusion canvas needs and an autoregressive mask does not:

  dist[s]   the fewest tokens that take state s to an accepting state (breadth-first search over
            the reversed transitions). A position with r positions left after it may take token t
            only if dist[next(s, t)] <= r, so every committed prefix can still be completed
            within the canvas: the finished answer parses (the canvas is never too short).
  masks     per (state, r) a bool [V] of the allowed tokens, built on demand on the host and
            cached there; the device gets a V-byte copy of the banned tokens for each row it must
            mask. End-of-text is allowed exactly in accepting states.

Why outlines-core and not xgrammar or llguidance (both faster to compile, both context-free):
their pushdown matchers say which tokens may come next but not how many tokens a completion
needs, so a fixed canvas could end inside an unfinished string; a token-level DFA gives that
distance exactly (measured costs: bench/results/structured_masks_cpu.json, docs/STRUCTURED.md).
The price: regular languages only. A context-free grammar (`grammar`, vLLM's guided_grammar) is
refused with that reason; recursive schemas are unrolled to outlines-core's bounded depth."""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict, deque

import torch

from ..config import int_range
from ..config.structured import ConstraintSpec
from ..errors import InputError

META = "\\.+*?()|[]{}^$"
INSTALL = "pip install 'mosaic-dllm[structured]' (outlines-core)"


def outlines():
    """The outlines_core module, or InputError saying how to install it."""
    try:
        import outlines_core
        import outlines_core.json_schema  # noqa: F401
    except ImportError:
        raise InputError(f"structured output (json_schema, regex, choice, response_format, tools) needs "
                         f"outlines-core: {INSTALL}") from None
    return outlines_core


def escape(text: str) -> str:
    """A literal for outlines-core's regex syntax (Rust regex: only its metacharacters escaped)."""
    return "".join("\\" + c if c in META else c for c in text)


def regex_of(spec: ConstraintSpec) -> str:
    """The regex the whole answer must match (InputError for a schema outlines-core refuses)."""
    if spec.kind == "grammar":
        raise InputError(f"{spec.name or 'grammar'}: context-free grammars are not supported: Mosaic compiles "
                         "regular languages (JSON schemas, regexes, choices) to a token-level automaton, which "
                         "is what guarantees an answer that fits the canvas (docs/STRUCTURED.md); express the "
                         "format as a JSON schema or a regex", param=spec.name or None)
    if spec.kind == "regex":
        return spec.value
    if spec.kind == "choice":
        return "(" + "|".join(escape(c) for c in spec.value) + ")"
    oc = outlines()
    tag = "mosaicintrange"
    while tag in spec.value:        # placeholders the schema cannot hold (config/int_range.py)
        tag += "q"
    try:
        schema, ranges = int_range.rewrite(json.loads(spec.value), tag=tag)
    except InputError as e:
        raise InputError(f"{spec.name or 'json_schema'}: {e}", param=spec.name or None) from None
    try:
        regex = oc.json_schema.build_regex_from_schema(json.dumps(schema) if ranges else spec.value, r"[ ]?")
    except Exception as e:   # noqa: BLE001  (outlines-core raises ValueError/TypeError with the reason)
        raise InputError(f"{spec.name or 'json_schema'}: the schema cannot be compiled: {e}",
                         param=spec.name or None) from None
    return int_range.fill(regex, ranges)    # integer bounds, which outlines-core does not encode


def token_bytes(tokenizer, skip=()) -> dict[bytes, list[int]]:
    """{the bytes a token spells: its ids} over the plain (not added/special) tokens of a
    `tokenizers` Tokenizer: byte-level BPE (GPT-2's byte alphabet), metaspace / byte-fallback
    (SentencePiece style: '▁' is a space, <0xNN> a byte) and literal vocabularies. skip: ids left
    out (end-of-text: outlines-core keeps it apart)."""
    tok = tokenizer.tok
    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    dec = type(tok.decoder).__name__ if tok.decoder is not None else ""
    inverse = byte_alphabet() if dec == "ByteLevel" else None
    out: dict[bytes, list[int]] = {}
    for text, i in tok.get_vocab(with_added_tokens=False).items():
        if text in added or not text or i in skip:
            continue
        if inverse is not None:
            try:
                b = bytes(inverse[c] for c in text)
            except KeyError:
                continue
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            b = bytes([int(text[3:5], 16)])
        else:
            b = text.replace("\u2581", " ").encode()
        out.setdefault(b, []).append(i)
    return out


@functools.lru_cache(maxsize=1)
def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: {character: byte}."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class Grammar:
    """A compiled constraint (module docstring): initial state, accepting states, transitions
    {state: {token: next}}, dist {state: fewest tokens to accept}, V (the LM head's width) and
    eos (the end-of-text id, allowed in accepting states). Masks are cached on the host per
    (state, r); thread-safe."""

    def __init__(self, index, vocab: int, eos: int):
        self.V, self.eos = vocab, eos
        self.initial = index.get_initial_state()
        self.finals = frozenset(index.get_final_states())
        self.next = {s: {t: n for t, n in row.items() if t != eos} for s, row in index.get_transitions().items()}
        self.dist = distances(self.next, self.finals)
        # per state: its tokens and their next states as tensors (a mask is then one scatter: ~0.1 ms at
        # V = 126k where building it from the dict took ~30 ms)
        self._arrays = {s: (torch.tensor(list(row.keys()), dtype=torch.long),
                            torch.tensor(list(row.values()), dtype=torch.long)) for s, row in self.next.items()}
        self._need = {s: max((self.dist.get(n, 1 << 30) for n in set(row.values())), default=0)
                      for s, row in self.next.items()}
        self._masks: OrderedDict = OrderedDict()
        self.lock = threading.Lock()
        self.pin = torch.cuda.is_available()       # pinned host masks: copied to the GPU without a wait

    def allows(self, state: int, token: int, left: int) -> bool:
        """Whether `token` may follow `state` with `left` positions after it."""
        if token == self.eos:
            return state in self.finals
        nxt = self.next.get(state, {}).get(token)
        return nxt is not None and self.dist.get(nxt, left + 1) <= left

    def advance(self, state: int, token: int) -> int:
        return state if token == self.eos else self.next[state][token]

    def mask(self, state: int, left: int, device="cpu") -> torch.Tensor:
        """bool [V]: the tokens allowed after `state` with `left` positions after this one (on
        `device`: a copy of the host mask, V bytes)."""
        m = self._host(state, left)[0]
        return m if torch.device(device).type == "cpu" else m.to(device)

    def banned(self, state: int, left: int, device) -> torch.Tensor:
        """bool [V] on `device`: the tokens NOT allowed (what a masked reduction sets to -inf).
        The host keeps the masks (256 cached, V bytes each: 32 MB at V = 126k of host memory);
        the device gets one V-byte copy per use, from pinned memory without a wait on CUDA, so the
        device holds no mask between steps (admission charges the one copy: constraint.py)."""
        inv = self._host(state, left)[1]
        if torch.device(device).type == "cpu":
            return inv
        return inv.to(device, non_blocking=True)

    def prefetch(self, state: int, left: int) -> None:
        """Build (and cache) the host mask of (state, left) now: called while the device runs a
        step, so that a row the walk must mask finds it ready."""
        self._host(state, left)

    def _host(self, state: int, left: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(allowed, banned) bool [V] on the host for (state, left), cached per (state, the room
        that binds): left beyond the state's farthest need gives the same mask."""
        key = (state, min(left, self._need.get(state, 0)))
        with self.lock:
            hit = self._masks.get(key)
            if hit is not None:
                self._masks.move_to_end(key)
                return hit
        need = self._need.get(state, 0)
        toks, nxt = self._array(state)
        keep = toks
        if left < need:      # the length binds: drop the tokens whose next state needs more than `left`
            uniq, inv = torch.unique(nxt, return_inverse=True)
            far = torch.tensor([self.dist.get(n, 1 << 30) for n in uniq.tolist()], dtype=torch.long)
            keep = toks[far[inv] <= left]
        m = torch.zeros(self.V, dtype=torch.bool)
        m[keep] = True
        if state in self.finals:
            m[self.eos] = True
        banned = ~m
        if self.pin:
            banned = banned.pin_memory()
        with self.lock:
            self._masks[key] = (m, banned)
            while len(self._masks) > 256:      # 2 x 256 x V bytes of host memory (64 MB at V = 126k)
                self._masks.popitem(last=False)
        return m, banned

    def _array(self, state: int):
        empty = torch.empty(0, dtype=torch.long)
        return self._arrays.get(state, (empty, empty))


def distances(nxt: dict, finals: frozenset) -> dict[int, int]:
    """{state: fewest tokens to an accepting state} by BFS over reversed edges (unreachable
    states are left out)."""
    back: dict[int, set] = {}
    for s, row in nxt.items():
        for n in set(row.values()):
            back.setdefault(n, set()).add(s)
    dist = {f: 0 for f in finals}
    queue = deque(finals)
    while queue:
        s = queue.popleft()
        for p in back.get(s, ()):
            if p not in dist:
                dist[p] = dist[s] + 1
                queue.append(p)
    return dist


class Compiler:
    """Compiles ConstraintSpecs for one model's tokenizer (the vocabulary converted once), with
    an LRU cache of compiled grammars (compiling a schema for a 126k vocabulary takes seconds)."""

    def __init__(self, tokenizer, vocab: int, eos: int | None, cache: int = 32):
        self.tokenizer, self.V, self.eos = tokenizer, vocab, eos
        self._vocabulary = None
        self._cache: OrderedDict = OrderedDict()
        self.lock = threading.Lock()

    def vocabulary(self):
        if self._vocabulary is None:
            oc = outlines()
            if self.tokenizer is None:
                raise InputError("structured output needs the model's tokenizer (tokenizer.json): this model has none")
            if self.eos is None:
                raise InputError("structured output ends the answer with end-of-text, and this model's config.json "
                                 "has none (eos_token_id)")
            self._vocabulary = oc.Vocabulary(self.eos, token_bytes(self.tokenizer, {self.eos}))
        return self._vocabulary

    def compile(self, spec: ConstraintSpec, length: int | None = None) -> Grammar:
        """The Grammar of spec (cached); InputError naming the problem when it cannot be compiled,
        when the vocabulary cannot spell it, or when its shortest answer exceeds `length` tokens."""
        with self.lock:
            g = self._cache.get(spec)
            if g is None:
                g = self._compile(spec)
                self._cache[spec] = g
                while len(self._cache) > 32:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(spec)
        if length is not None and g.dist.get(g.initial, length + 1) > length:
            need = g.dist.get(g.initial)
            raise InputError(f"{spec.name or spec.kind}: the shortest answer it allows takes {need} tokens, more than "
                             f"max_tokens {length}: raise max_tokens" if need is not None else
                             f"{spec.name or spec.kind}: no answer it allows can be spelled with this vocabulary",
                             param=spec.name or None)
        return g

    def _compile(self, spec: ConstraintSpec) -> Grammar:
        regex = regex_of(spec)
        oc = outlines()
        try:
            index = oc.Index(regex, self.vocabulary())
        except Exception as e:   # noqa: BLE001  (ValueError: bad regex, or a character no token spells)
            raise InputError(f"{spec.name or spec.kind}: cannot be compiled for this model's vocabulary: "
                             f"{self.why_not(str(e))}", param=spec.name or None) from None
        return Grammar(index, self.V, self.eos)

    def why_not(self, error: str) -> str:
        """outlines-core's compile error, short: its "no token spells these characters" (which
        quotes the whole compiled regex: 1,900 characters for json_object) becomes the characters
        missing and, for a small vocabulary (64 characters or fewer), the ones it spells."""
        missing = re.search(r"following characters: (\[.*?\])", error)
        if missing is None:
            return error if len(error) <= 300 else error[:300] + " ..."
        chars = sorted(set(b"".join(token_bytes(self.tokenizer, {self.eos})).decode("utf-8", "replace")))
        spelled = f"; its tokens spell only {''.join(chars)!r}: a regex or choice over those fits" \
            if len(chars) <= 64 else ""
        return f"the format needs one of the characters {missing.group(1)}, which no token spells{spelled}"
