"""The grammar libraries measured side by side (`python -m bench structured --part masks`):
xgrammar, llguidance and outlines-core on byte-level BPE vocabularies of LLaDA's and LLaDA2's
sizes (126,464 and 157,184 tokens, trained here on Python source with `tokenizers`, since no
real tokenizer file can be downloaded).

Per library and vocabulary: the one-time preparation of the vocabulary, the compile time of each
constraint (a nested JSON schema, a regex, a choice), and the mask of every step along a valid
answer (the time to produce the allowed-token bitmask for the next token, then accept the token).
For outlines-core also Mosaic's own mask (runtime/grammar.Grammar.mask: a bool [V] per DFA state
and positions left, built on first use and cached). A library that is not installed is recorded
as missing; the committed record ran with all three installed in a side environment."""

from __future__ import annotations

import glob
import json
import os
import statistics
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "score": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string"}}, "kind": {"enum": ["cat", "dog", "bird"]},
    "owner": {"type": "object", "properties": {"id": {"type": "integer"}, "active": {"type": "boolean"}},
              "required": ["id", "active"], "additionalProperties": False}},
    "required": ["name", "age", "score", "tags", "kind", "owner"], "additionalProperties": False}
DOCS = {"json_schema": '{"name":"Alice Smith","age":42,"score":3.5,"tags":["a","bc"],"kind":"dog",'
                       '"owner":{"id":7,"active":true}}',
        "regex": "2026-12-02T17:45:00Z",
        "choice": "positive"}
REGEX = r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z"
CHOICES = ["positive", "negative", "neutral"]


def tokenizer_file(V: int, cache: Path) -> Path:
    """A byte-level BPE tokenizer of V tokens (<|eos|>, <|mask|> included), trained once on up to
    150 MB of the Python sources on this machine and kept under `cache`."""
    path = cache / f"bpe_{V}.json"
    if path.exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    files, size = [], 0
    for f in sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True)):
        files.append(f)
        size += os.path.getsize(f)
        if size > 150e6:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=V, min_frequency=2, special_tokens=["<|eos|>", "<|mask|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    cache.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def summary(ts: list[float]) -> dict:
    us = sorted(t * 1e6 for t in ts)
    return {"steps": len(us), "median_us": statistics.median(us), "p90_us": us[int(0.9 * (len(us) - 1))],
            "max_us": us[-1], "mean_us": statistics.mean(us)}


def run_library(lib: str, path: Path) -> dict:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(path))
    V, eos = tok.get_vocab_size(), tok.token_to_id("<|eos|>")
    t0 = time.perf_counter()
    prep = PREPARE[lib](path, tok, eos)
    out = {"vocab": V, "prepare_s": time.perf_counter() - t0, "constraints": {}}
    for kind in DOCS:
        ids = tok.encode(DOCS[kind]).ids
        t = time.perf_counter()
        walker = COMPILE[lib](prep, kind)
        compile_s = time.perf_counter() - t
        times, extra = walker(ids)
        out["constraints"][kind] = {"compile_s": compile_s, "tokens": len(ids), "mask": summary(times)} | extra
    return out


# -- each library: prepare(path, tok, eos) -> state; compile(state, kind) -> walk(ids) -> (mask times, extra)

def _llg_prepare(path, tok, eos):
    import llguidance
    return llguidance.LLTokenizer(path.read_text(), eos_token=eos)


def _llg_compile(llt, kind):
    import llguidance
    import llguidance.torch as lt
    M = llguidance.LLMatcher
    g = {"json_schema": lambda: M.grammar_from_json_schema(SCHEMA), "regex": lambda: M.grammar_from_regex(REGEX),
         "choice": lambda: M.grammar_from_regex("(" + "|".join(CHOICES) + ")")}[kind]()
    m = M(llt, g)
    assert not m.is_error(), m.get_error()

    def walk(ids):
        bm, ts = lt.allocate_token_bitmask(1, llt.vocab_size), []
        for i in ids:
            t = time.perf_counter()
            lt.fill_next_token_bitmask(m, bm, 0)
            ts.append(time.perf_counter() - t)
            assert m.consume_token(i), m.get_error()
        return ts, {"accepting": m.is_accepting()}
    return walk


def _xgr_prepare(path, tok, eos):
    import xgrammar as xgr
    vocab = tok.get_vocab()
    info = xgr.TokenizerInfo(sorted(vocab, key=vocab.get), vocab_type=xgr.VocabType.BYTE_LEVEL, stop_token_ids=[eos])
    return xgr.GrammarCompiler(info, max_threads=2), info


def _xgr_compile(prep, kind):
    import xgrammar as xgr
    comp, info = prep
    cg = {"json_schema": lambda: comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                          separators=(",", ":")),
          "regex": lambda: comp.compile_regex(REGEX),
          "choice": lambda: comp.compile_regex("(" + "|".join(CHOICES) + ")")}[kind]()
    m = xgr.GrammarMatcher(cg)

    def walk(ids):
        bm, ts = xgr.allocate_token_bitmask(1, info.vocab_size), []
        for i in ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(bm, 0)
            ts.append(time.perf_counter() - t)
            assert m.accept_token(i)
        return ts, {}
    return walk


class _Tok:
    def __init__(self, tok):
        self.tok = tok


def _oc_prepare(path, tok, eos):
    from mosaic.runtime.grammar import Compiler
    c = Compiler(_Tok(tok), tok.get_vocab_size(), eos)
    c.vocabulary()
    return c


def _oc_compile(c, kind):
    import torch

    from mosaic.config.structured import spec_of
    spec = {"json_schema": lambda: spec_of(json_schema=SCHEMA), "regex": lambda: spec_of(regex=REGEX),
            "choice": lambda: spec_of(choice=CHOICES)}[kind]()
    g = c.compile(spec)

    def walk(ids):
        first, cached = [], []
        bm = torch.zeros((g.V + 31) // 32, dtype=torch.int32)
        s, left = g.initial, len(ids)
        for i in ids:
            left -= 1
            t = time.perf_counter()
            g.mask(s, left, "cpu")
            first.append(time.perf_counter() - t)
            t = time.perf_counter()
            g.mask(s, left, "cpu")
            cached.append(time.perf_counter() - t)
            assert g.allows(s, i, left)
            s = g.advance(s, i)
        return first, {"mosaic_mask_cached": summary(cached), "states": len(g.next),
                       "transitions": sum(len(r) for r in g.next.values()), "accepting": s in g.finals,
                       "bitmask_bytes_per_state": bm.numel() * 4}
    return walk


PREPARE = {"llguidance": _llg_prepare, "xgrammar": _xgr_prepare, "outlines-core": _oc_prepare}
COMPILE = {"llguidance": _llg_compile, "xgrammar": _xgr_compile, "outlines-core": _oc_compile}
MODULES = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines-core": "outlines_core"}


def masks(vocabs: list[int], cache: Path) -> dict:
    import importlib.metadata as md
    import importlib.util
    out = {"versions": {}, "libraries": {}}
    for lib, mod in MODULES.items():
        out["versions"][lib] = md.version(lib) if importlib.util.find_spec(mod) else None
    for V in vocabs:
        path = tokenizer_file(V, cache)
        for lib in MODULES:
            key = f"{lib}@{V}"
            if out["versions"][lib] is None:
                out["libraries"][key] = {"missing": True}
                continue
            try:
                out["libraries"][key] = run_library(lib, path)
            except Exception as e:   # noqa: BLE001  (one library failing must not lose the others)
                out["libraries"][key] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(key, json.dumps(out["libraries"][key])[:300], flush=True)
    return out



