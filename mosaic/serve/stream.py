"""Committed text of a denoising canvas, as deltas: what a streaming client may be sent.

A dLLM fills its canvas out of order, but a position, once unmasked, never changes (LLaDA and
Dream transfer only masked positions). So the generated tokens up to the first still-masked
position are final: their text is "committed". The answer ends at the first end-of-text token
or at the first stop string, whichever comes first; once the committed prefix reaches either,
nothing later in the canvas can change the answer, and denoising may stop early."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

REPLACEMENT = "\ufffd"  # an incomplete multi-byte character decoded on its own


@dataclass
class CommittedText:
    """Tracks one sequence. decode(ids) -> text (the engine's decode: cuts at end-of-text, drops
    mask ids); stop: stop strings; eos_id: the model's end-of-text id, or all of them (config.json
    may list several: eos_ids(cfg)), None for none; mask_id: its mask id.

    update(gen_ids) returns the new text to send (maybe ""); `done` says the answer is complete
    ("stop" when end-of-text or a stop string ended it); `text` is everything sent so far.
    stop_ids: token ids that end the answer as vLLM's stop_token_ids do (the answer keeps the
    token, whose text a special token does not have); stop_reason: the stop string or stop id
    that ended it (None: end-of-text, or the canvas filled)."""
    decode: object
    eos_id: int | Collection[int] | None
    mask_id: int
    stop: list[str] = field(default_factory=list)
    stop_ids: Collection[int] = ()
    stop_reason: str | int | None = None
    text: str = ""
    done: str | None = None
    committed_tokens: int = 0   # generated tokens known final (up to the first mask)
    answer_tokens: int | None = None   # tokens before the first end-of-text, once known
    answer_ids: list[int] | None = None  # those tokens (trimmed at a stop string), once done

    def update(self, gen_ids: torch.Tensor | list[int], final: bool = False) -> str:
        """gen_ids: the generated part of the canvas [G] (mask ids where still masked). final:
        the canvas is complete (every position committed)."""
        if self.done:
            return ""
        ids = gen_ids.tolist() if isinstance(gen_ids, torch.Tensor) else list(gen_ids)
        n = len(ids) if final else _first(ids, self.mask_id, len(ids))
        if n == self.committed_tokens and not final:
            return ""
        self.committed_tokens = n
        prefix = ids[:n]
        eos = _first_of(prefix, set(_as_ids(self.eos_id)) | set(self.stop_ids))
        if eos is not None:
            keep = eos + 1 if prefix[eos] in self.stop_ids and prefix[eos] not in _as_ids(self.eos_id) else eos
            self.stop_reason = prefix[eos] if keep > eos else None
            prefix, self.answer_tokens = prefix[:keep], keep
        elif final:
            self.answer_tokens = n
        full = self.decode(prefix)
        cut = self._stop_at(full)
        if cut is not None:
            self.stop_reason = next(s for s in self.stop if full.find(s) == cut)
            full, self.done = full[:cut], "stop"
            self.answer_tokens = self._tokens_for(prefix, cut)
        elif eos is not None:
            self.done = "stop"
        elif final:
            self.done = "length"
        if self.done:
            self.answer_ids = prefix[: self.answer_tokens]
        safe = full if self.done else full[: len(full) - self._holdback(full)]
        if not safe.startswith(self.text):   # decoding is not prefix-stable here: wait
            return ""
        delta, self.text = safe[len(self.text):], safe
        return delta

    def _tokens_for(self, ids: list[int], chars: int) -> int:
        """The fewest leading tokens of ids whose text reaches `chars` characters (binary search:
        the decoded length grows with the token count)."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.decode(ids[:mid])) >= chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _stop_at(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        """Characters at the end that may still change: a partial character, or the start of a
        stop string."""
        keep = 0
        while keep < len(text) and text[len(text) - 1 - keep] == REPLACEMENT:
            keep += 1
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        return keep


def eos_ids(cfg) -> tuple[int, ...]:
    """Every end-of-text id of a ModelConfig: eos_id and the extra ones config.json lists."""
    return tuple(i for i in (cfg.eos_id, *cfg.extra_eos_ids) if i is not None)


def _as_ids(eos) -> tuple[int, ...]:
    """End-of-text ids as a tuple (an id, a collection, or None)."""
    return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)


def _first_of(ids: list[int], eos) -> int | None:
    """Index of the first end-of-text token (any of `eos`: an id, a collection, or None)."""
    if eos is None or isinstance(eos, int):
        return _first(ids, eos, None)
    ends = set(eos)
    return next((j for j, i in enumerate(ids) if i in ends), None)


def _first(ids: list[int], value: int, default):
    try:
        return ids.index(value)
    except ValueError:
        return default


def render_canvas(decode_piece, gen_ids: list[int], mask_id: int, mask_text: str = "_") -> str:
    """The canvas as text with every still-masked position shown as `mask_text` (a preview:
    runs of tokens are decoded one run at a time)."""
    out, run = [], []
    for t in gen_ids:
        if t == mask_id:
            if run:
                out.append(decode_piece(run))
                run = []
            out.append(mask_text)
        else:
            run.append(t)
    if run:
        out.append(decode_piece(run))
    return "".join(out)
