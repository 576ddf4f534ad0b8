"""tokenizer.json through `tokenizers`, plus the chat template and special tokens as the
checkpoint folder stores them.

Folders written by different transformers versions keep the chat template in different places:
older ones inside tokenizer_config.json ("chat_template": a string, or a list of named
templates), newer ones (>= 4.47) in chat_template.jinja next to it, processors in
chat_template.json; special tokens sit in tokenizer_config.json or special_tokens_map.json.
All are read; a separate file wins over the field (as transformers does when it loads)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from .errors import CheckpointError, InputError

SHOW_VOCAB = 64  # a vocabulary this small is listed in full when a character is refused
# every character str.isspace() accepts, by its UTF-8 length: a pre-tokenizer may drop whitespace, so
# least_tokens() counts none of it
_SPACES = {n: [c for c in map(chr, range(0x3001)) if c.isspace() and len(c.encode()) == n] for n in (1, 2, 3)}


class TextTokenizer:
    def __init__(self, tok, settings: dict, chat_template: str | None = None):
        self.tok = tok
        self.settings = settings
        self.chat_template = chat_template if chat_template is not None else _template(settings.get("chat_template"))
        self.bos_token = _token(settings.get("bos_token"))
        self.eos_token = _token(settings.get("eos_token"))
        self.bos_id = tok.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos = bool(settings.get("add_bos_token", False)) and self.bos_id is not None
        unk = getattr(tok.model, "unk_token", None)
        self.unk_token = unk if isinstance(unk, str) else None
        self.unk_id = tok.token_to_id(unk) if self.unk_token else None

    @classmethod
    def from_folder(cls, folder: Path) -> TextTokenizer | None:
        """None when the folder has no tokenizer.json (then prompts must be token ids)."""
        path = folder / "tokenizer.json"
        if not path.exists():
            return None
        from tokenizers import Tokenizer
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library's own message names the problem
            raise CheckpointError(f"cannot read {path}: {e}") from e
        settings = _json(folder / "tokenizer_config.json")
        for k, v in _json(folder / "special_tokens_map.json").items():
            settings.setdefault(k, v)
        template = None
        if (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        elif (folder / "chat_template.json").exists():
            template = _template(_json(folder / "chat_template.json").get("chat_template"))
        return cls(tok, settings, template)

    @functools.cached_property
    def plain_vocab(self) -> list[str]:
        """The vocabulary without the <|...|> special tokens, in id order."""
        vocab = self.tok.get_vocab()
        return sorted((t for t in vocab if not (t.startswith("<|") and t.endswith("|>"))), key=vocab.get)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of input one plain (not added) token of the vocabulary covers, computed
        once: its text's UTF-8 length, or its length in characters for a byte-level vocabulary
        (one character per byte). A token's text spells at least the bytes it covers (a metaspace
        symbol, a '##' prefix, a <0xNN> byte token spell more), so text of B bytes, less what
        added tokens cover, needs at least B / max_token_bytes tokens (least_tokens)."""
        byte_level = type(self.tok.decoder).__name__ == "ByteLevel"
        added = {t.content for t in self.tok.get_added_tokens_decoder().values()}
        plain = [t for t in self.tok.get_vocab(with_added_tokens=False) if t not in added]
        return max((len(t) if byte_level else len(t.encode()) for t in plain), default=1) or 1

    @functools.cached_property
    def _added_prefixes(self) -> dict[str, int]:
        """{first two characters: most UTF-8 bytes of an added token starting with them}, for the
        added tokens longer than max_token_bytes (a text spelling one is one token)."""
        out: dict[str, int] = {}
        for t in self.tok.get_added_tokens_decoder().values():
            n = len(t.content.encode())
            if t.content and n > self.max_token_bytes:
                out[t.content[:2]] = max(out.get(t.content[:2], 0), n)
        return out

    def least_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` encodes to, without encoding it: its bytes, less
        every whitespace character (a pre-tokenizer may drop them) and the most that added tokens
        spelled in it can cover (each occurrence of an added token's first two characters counted
        as its longest), over max_token_bytes. 0 (no bound) when the tokenizer has a normalizer,
        which may shorten the text before it is cut. Text the vocabulary cannot encode is refused
        by encode() anyway. Cost: a few dozen str.count passes (~0.1 s for 14 MB); never above
        4 * len(text) / max_token_bytes + 1, so a caller can skip short texts."""
        if self.tok.normalizer is not None or not text:
            return 0
        raw = len(text.encode("utf-8", "surrogatepass"))
        spaces = sum(n * text.count(c) for n, chars in _SPACES.items() for c in chars)
        added = sum(longest * text.count(prefix) for prefix, longest in self._added_prefixes.items())
        return -(-max(0, raw - spaces - added) // self.max_token_bytes)   # ceil: a token count is whole

    @functools.cached_property
    def word_level(self) -> bool:
        """True for a whole-word vocabulary whose decoder joins tokens with spaces (tiny-long;
        not tiny-llada's one-character words): unknown input is reported by word, and decoded
        text needs a space between a prompt and its answer. Decided once per tokenizer."""
        if type(self.tok.model).__name__ != "WordLevel":
            return False
        two = [self.tok.token_to_id(t) for t in self.plain_vocab if t and t.strip() == t][:2]
        return len(two) == 2 and " " in self.tok.decode(two)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (with the BOS the tokenizer settings ask for). Raises InputError
        naming the characters the vocabulary cannot encode (they would otherwise become the
        unknown token, which small vocabularies map to end-of-text, or vanish)."""
        enc = self.tok.encode(text, add_special_tokens=True)
        self._check_covered(text, enc)
        ids = enc.ids
        if self.add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def _check_covered(self, text: str, enc) -> None:
        covered = [False] * len(text)
        bad: list[str] = []
        words = self.word_level   # whole words are the unit (tiny-long)
        for i, (a, b) in zip(enc.ids, enc.offsets):
            piece = text[a:b]
            if self.unk_id is not None and i == self.unk_id and piece != self.unk_token:
                if words:
                    bad.append(piece)
                else:
                    bad.extend(piece)
            for j in range(a, min(b, len(text))):
                covered[j] = True
        bad += [c for c, seen in zip(text, covered) if not seen and not c.isspace()]
        if not bad:
            return
        fate = f"they would be read as {self.unk_token!r}" if self.unk_token else "they would be dropped"
        plain = self.plain_vocab
        if words:
            unknown = ", ".join(repr(w) for w in dict.fromkeys(bad))
            raise InputError(f"the prompt has words this tokenizer does not know: {unknown}; {fate}. Its "
                             f"{len(plain):,} words include {' '.join(plain[:6])} ... {' '.join(plain[-6:])}")
        chars = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in dict.fromkeys(bad))
        msg = f"the prompt has characters this tokenizer cannot encode: {chars}; {fate}"
        if self.tok.get_vocab_size() <= SHOW_VOCAB:
            msg += f". The vocabulary: {' '.join(repr(t) for t in plain)}"
        raise InputError(msg)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None) -> str:
        """The chat template rendered over messages (tools: OpenAI function specs, given to
        templates that render them, as transformers passes `tools`)."""
        if not self.chat_template:
            raise CheckpointError("this tokenizer has no chat template (looked for chat_template.jinja, "
                                  "chat_template.json and the chat_template field of tokenizer_config.json)")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):  # what HF templates call on a malformed conversation
            raise InputError(f"the chat template refused the messages: {message}")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            extra = {} if tools is None else {"tools": tools}
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except TemplateError as e:
            raise CheckpointError(f"the chat template cannot be rendered: {e}") from e

    @functools.cached_property
    def special_tokens(self) -> tuple[str, ...]:
        """The text of every special (control) token of the vocabulary: <|eos|>, <|bos|>, ..."""
        added = self.tok.get_added_tokens_decoder()
        return tuple(t.content for _, t in sorted(added.items()) if t.special)

    @functools.cached_property
    def _literal(self):
        """A copy of the tokenizer that reads special-token text as plain text (HF's
        split_special_tokens=True): a second object, so that concurrent encodes never see the
        switch."""
        from tokenizers import Tokenizer
        tok = Tokenizer.from_str(self.tok.to_str())
        tok.encode_special_tokens = True
        return tok

    def encode_chat(self, messages: list[dict], tools=None) -> list[int]:
        """Token ids of the chat template applied to messages. Only the template writes control
        tokens: text inside a message that spells one (<|eos|>, <|bos|>, ...) is encoded as plain
        text, as HF's tokenizers do with split_special_tokens=True, while the template's own
        special tokens stay special. Messages without such text are encoded exactly as before
        (one encode of the rendered template). Raises InputError when the spelled token cannot
        be written with the vocabulary's plain tokens, or the template rewrites message text so
        that it cannot be kept apart from the template's."""
        # the template writes the BOS itself; encode without adding another
        text = self.apply_chat_template(messages, tools=tools)
        spelled = sorted({t for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)
                          for t in self.special_tokens if t in m["content"]})
        if not spelled:
            enc = self.tok.encode(text, add_special_tokens=False)
            self._check_covered(text, enc)
            return enc.ids
        return self._encode_chat_literal(messages, text, spelled, tools)

    def _encode_chat_literal(self, messages: list[dict], text: str, spelled: list[str], tools=None) -> list[int]:
        """The template's text around the messages encoded as usual, each message's content with
        special-token text read as plain text."""
        names = ", ".join(repr(t) for t in spelled)
        marks, shadow = [], []
        for i, m in enumerate(messages):
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                mark = f"\ue000{i}\ue001"            # private-use characters: in no message
                marks.append((mark, m["content"]))
                m = {**m, "content": mark}
            shadow.append(m)
        rendered = self.apply_chat_template(shadow, tools=tools)
        pieces, rest = [], rendered
        for mark, content in marks:
            head, found, rest = rest.partition(mark)
            if not found:
                break
            pieces += [(head, False), (content, True)]
        pieces.append((rest, False))
        if "".join(p for p, _ in pieces) != text:
            raise InputError(f"a message spells the special token {names}, which message text never becomes, and "
                             "this chat template rewrites message text, so it cannot be kept as plain text; "
                             "remove it from the message")
        ids = []
        for piece, literal in pieces:
            if not piece:
                continue
            enc = (self._literal if literal else self.tok).encode(piece, add_special_tokens=False)
            try:
                self._check_covered(piece, enc)
            except InputError as e:
                if not literal:
                    raise
                raise InputError(f"a message spells the special token {names}: message text never becomes a "
                                 f"control token (only the chat template writes them), and as plain text {e}") from e
            ids += enc.ids
        return ids


def _json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not an object of fields")
    return data


def _template(value) -> str | None:
    """A chat_template field: a string, or a list of {"name", "template"} (the one named default)."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return value if isinstance(value, str) else None


def _token(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised form
        return value.get("content")
    return value if isinstance(value, str) else None
