"""tokenizer.json through `tokenizers`, plus the chat template of tokenizer_config.json."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import CheckpointError


class TextTokenizer:
    def __init__(self, tok, settings: dict):
        self.tok = tok
        self.settings = settings
        self.chat_template = settings.get("chat_template")
        self.bos_token = _token(settings.get("bos_token"))
        self.eos_token = _token(settings.get("eos_token"))
        self.bos_id = tok.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos = bool(settings.get("add_bos_token", False)) and self.bos_id is not None

    @classmethod
    def from_folder(cls, folder: Path) -> TextTokenizer | None:
        path = folder / "tokenizer.json"
        if not path.exists():
            return None
        from tokenizers import Tokenizer
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library's own message names the problem
            raise CheckpointError(f"cannot read {path}: {e}") from e
        cfg_path = folder / "tokenizer_config.json"
        settings = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        return cls(tok, settings)

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=True).ids
        if self.add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise CheckpointError("this tokenizer has no chat_template in tokenizer_config.json")
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # the template writes the BOS itself; encode without adding another
        return self.tok.encode(self.apply_chat_template(messages), add_special_tokens=False).ids


def _token(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised form
        return value.get("content")
    return value
