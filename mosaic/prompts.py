"""Prompts and lengths: the one place a request's prompts are read and checked.

A prompt is text, chat messages, a list of token ids, a [B, L] tensor of ids, or a left-padded
batch with its attention mask (the official calling conventions). Everything is refused with an
InputError naming what was wrong before any work starts: ids outside the vocabulary, text the
tokenizer cannot encode, the mask token inside a prompt, padding that is not on the left."""

from __future__ import annotations

import warnings

import torch

from .errors import InputError


class LengthWarning(UserWarning):
    """A request longer than the model's maximum (trained) length: it runs, quality may drop."""


def _is_text(p) -> bool:
    return isinstance(p, str) or (isinstance(p, list) and bool(p) and isinstance(p[0], dict))


def encode(model, prompt, chat: bool = False, tools=None) -> list[list[int]]:
    """Text, token ids, chat messages, or a list of those -> token id lists (tools: function specs
    for a chat template that renders them). Raises InputError for anything else, for ids outside
    the vocabulary and for text the tokenizer cannot encode."""
    out = []
    for p in _as_prompts(prompt):
        ids = _encode_text(model, p, chat, tools) if _is_text(p) else _ids_of(p, chat)
        if not ids:
            raise InputError("a prompt encodes to zero tokens")
        bad = [i for i in ids if not 0 <= i < model.cfg.vocab]
        if bad:
            raise InputError(f"token ids {bad[:8]} are outside the vocabulary [0, {model.cfg.vocab})")
        out.append(ids)
    return out


def _as_prompts(prompt) -> list:
    """A list of prompts from one prompt, a list of them or a [L] / [B, L] tensor of ids."""
    if isinstance(prompt, torch.Tensor):
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise InputError(f"a prompt tensor must hold integer token ids, not {prompt.dtype}")
        if prompt.dim() not in (1, 2):
            raise InputError(f"a prompt tensor must be [L] or [B, L] token ids, got shape {list(prompt.shape)}")
        prompt = prompt.tolist()
    if isinstance(prompt, (str, dict)) or (isinstance(prompt, list) and prompt
                                            and isinstance(prompt[0], (int, dict))):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise InputError("prompt must be a string, a list of token ids, or a non-empty list of those")
    return prompt


def _encode_text(model, p, chat: bool, tools=None) -> list[int]:
    """Text or chat messages through the tokenizer (chat: inside the model's chat template)."""
    tok = model.tokenizer
    if isinstance(p, str) and not p.strip():
        raise InputError("the prompt is empty: give some text (a model answers nothing sensible "
                         "to its BOS token alone)")
    if tok is None:
        raise InputError(f"model {model.name} has no tokenizer.json, so prompts must be token ids "
                         "(a list of ints; on the command line: --ids 1,2,3)")
    if chat or not isinstance(p, str):
        return tok.encode_chat([{"role": "user", "content": p}] if isinstance(p, str) else p, tools)
    return tok.encode(p)


def _ids_of(p, chat: bool) -> list[int]:
    """A prompt given as token ids (InputError for anything else, or with chat=True)."""
    if chat:
        raise InputError("chat=True wraps text in the chat template; it does not apply to token ids")
    if isinstance(p, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in p):
        return list(p)
    inner = f" of {type(p[0]).__name__}" if isinstance(p, list) and p else ""
    raise InputError("a prompt must be a string, chat messages or a list of token ids (ints); "
                     f"got {type(p).__name__}{inner}")


def unpad(model, inputs, attention_mask) -> tuple[list[list[int]], int]:
    """Prompt id lists and the padded width P from a left-padded [B, P] batch of token ids (a
    tensor or nested lists) and its attention mask (1 = token, 0 = padding), as the official
    calling conventions take them. Raises InputError for a mask that does not match the ids or
    pads anywhere but on the left."""
    ids = inputs if isinstance(inputs, torch.Tensor) else torch.as_tensor(inputs)
    mask = attention_mask if isinstance(attention_mask, torch.Tensor) else torch.as_tensor(attention_mask)
    if ids.dim() == 1:
        ids, mask = ids[None], mask.reshape(1, -1) if mask.dim() == 1 else mask
    if ids.dim() != 2 or tuple(mask.shape) != tuple(ids.shape):
        raise InputError(f"attention_mask has shape {list(mask.shape)} but the prompt ids have "
                         f"{list(ids.shape)}: they must match ([B, L], 1 = token, 0 = padding)")
    mask = mask.to("cpu")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise InputError("attention_mask must hold only 0 (padding) and 1 (token)")
    valid = mask != 0
    lead = (~valid).long().cumprod(dim=1).sum(dim=1)      # leading zeros per row
    if not bool((valid.sum(dim=1) + lead == valid.shape[1]).all()):
        raise InputError("attention_mask must mark padding on the left only (zeros, then ones): the "
                         "diffusion samplers generate to the right of the prompt")
    if not bool(valid.any(dim=1).all()):
        raise InputError("a row of attention_mask is all zeros: every prompt needs a token")
    rows = [r[v].tolist() for r, v in zip(ids.to("cpu"), valid)]
    return encode(model, rows), int(ids.shape[1])


def pad_filler(cfg) -> int:
    """The id left padding is filled with: the pad token, else end-of-text, else 0 — never the
    mask token (the samplers would take it for a position to fill). Which id it is does not
    change any token: padded keys are masked and padded rows are never read."""
    for i in (cfg.pad_id, cfg.eos_id, 0, 1):
        if i is not None and i != cfg.mask_id and 0 <= i < cfg.vocab:
            return i
    raise InputError("no token id is free to pad a batch with")  # a vocabulary of one token


def check_prompts(cfg, prompts: list[list[int]]) -> None:
    """Refuse the mask token inside a prompt (docs/INPUTS.md): the samplers would take it for a
    position to fill, and LLaDA would spend a block's unmasking budget on it."""
    for n, p in enumerate(prompts):
        where = [j for j, t in enumerate(p) if t == cfg.mask_id]
        if where:
            raise InputError(
                f"prompt {n} contains the mask token (id {cfg.mask_id}) at position{'s' * (len(where) > 1)} "
                f"{', '.join(map(str, where[:8]))}; prompts must not hold it: the sampler would take it for a "
                "position to fill (for LLaDA it also uses up a block's unmasking budget, so the answer would "
                "come back a token short). Remove it from the prompt")


def warn_length(prompt_len: int, new_tokens: int, trained: int) -> None:
    """LengthWarning: prompt + new tokens beyond the model's maximum length (it runs)."""
    warnings.warn(f"prompt ({prompt_len} tokens) + max_new_tokens ({new_tokens}) = {prompt_len + new_tokens} "
                  f"tokens is longer than this model's maximum length {trained} (config.json); it runs, but "
                  "the answer may degrade beyond the trained length", LengthWarning, stacklevel=4)
