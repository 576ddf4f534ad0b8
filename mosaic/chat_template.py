"""Chat templates rendered in the environment transformers renders them in, in a sandbox.

A checkpoint's chat template is Jinja written against transformers' `apply_chat_template`
(transformers/utils/chat_template_utils.py, `_compile_jinja_template`), so it may use what that
environment provides beyond plain Jinja, and Mosaic provides the same:

  - an `ImmutableSandboxedEnvironment` with trim_blocks and lstrip_blocks (a template can read
    the messages, never change them or reach Python objects);
  - loop controls, `{% break %}` / `{% continue %}` (jinja2.ext.loopcontrols);
  - `{% generation %} ... {% endgeneration %}`, which marks the assistant's tokens for training
    masks and renders its body unchanged;
  - `raise_exception(message)` (a template refusing a conversation: InputError) and
    `strftime_now(format)` (today's date in system prompts);
  - `tojson` without HTML escaping (json.dumps with ensure_ascii=False and its indent,
    separators and sort_keys options), where Jinja's own escapes <, > and &;
  - the variables `messages`, `tools` (the request's, or None), `documents` (None), `add_generation_prompt` and
    every special token of the tokenizer by name (bos_token, eos_token, unk_token, pad_token,
    mask_token, ..., additional_special_tokens), plus the caller's chat_template_kwargs.

`continue_final_message` and `add_generation_prompt` behave as in transformers and vLLM: the
first leaves the last message open (the rendered text is cut right after its content, so the
model continues it: a "prefilled" assistant turn), the second appends the template's opening of
an assistant turn; the two are refused together."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from datetime import datetime

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import CheckpointError, InputError


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation is rendered: add_generation_prompt (None: True unless the final
    message is continued), continue_final_message, extra template variables (vLLM's
    chat_template_kwargs, e.g. {"enable_thinking": false}) and tools (OpenAI function specs for
    a template that renders them, as transformers passes `tools`; None: none)."""
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    kwargs: dict = field(default_factory=dict)
    tools: list | None = None

    def __post_init__(self):
        for name in ("add_generation_prompt", "continue_final_message"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or (value is None and name == "add_generation_prompt")):
                raise InputError(f"{name} must be true or false, got {value!r}", param=name)
        if not isinstance(self.kwargs, dict) or not all(isinstance(k, str) for k in self.kwargs):
            raise InputError("chat_template_kwargs must be an object of template variables (names to values)",
                             param="chat_template_kwargs")
        if self.add_generation_prompt and self.continue_final_message:
            raise InputError("add_generation_prompt and continue_final_message cannot both be true: the first "
                             "opens a new assistant turn, the second continues the last message (give "
                             "add_generation_prompt false, or leave it out)", param="continue_final_message")

    @property
    def generation_prompt(self) -> bool:
        return (not self.continue_final_message) if self.add_generation_prompt is None else self.add_generation_prompt


DEFAULT_OPTIONS = ChatOptions()


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers tracks the assistant's characters
    there (return_assistant_tokens_mask); rendering, it is the body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise InputError(f"the chat template refused the messages: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def compile_template(source: str):
    """The template compiled in transformers' environment (module docstring); CheckpointError
    for a template that is not valid Jinja (the checkpoint's fault, not the request's)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise CheckpointError(f"the chat template is not valid Jinja: {e}") from e


def render(source: str, messages: list[dict], specials: dict, options: ChatOptions = DEFAULT_OPTIONS) -> str:
    """The conversation as the template writes it. specials: the tokenizer's special tokens by
    name (bos_token, ...). Raises InputError when the template refuses the messages or the
    final message to continue is not in its output, CheckpointError when it cannot render."""
    template = compile_template(source)
    variables = {**specials, **options.kwargs}
    try:
        text = template.render(messages=messages, tools=options.tools, documents=None,
                               add_generation_prompt=options.generation_prompt, **variables)
    except InputError:
        raise
    except TemplateError as e:
        raise CheckpointError(f"the chat template cannot be rendered: {e}") from e
    return continue_final(text, messages) if options.continue_final_message else text


def continue_final(text: str, messages: list[dict]) -> str:
    """`text` cut right after the last message's content (transformers' continue_final_message:
    where the template keeps the content's spacing, after the content as given; where it trims
    it, after the trimmed content), so that nothing of the template closes the turn."""
    final = messages[-1].get("content") if messages and isinstance(messages[-1], dict) else None
    if isinstance(final, list):     # content parts: the last text part is continued
        final = next((p.get("text") for p in reversed(final) if isinstance(p, dict) and "text" in p), None)
    if not isinstance(final, str) or not final.strip():
        raise InputError("continue_final_message: the last message has no text to continue")
    at = text.rfind(final.strip())
    if at < 0:
        raise InputError("continue_final_message: the last message does not appear in the chat template's output, "
                         "so it cannot be continued")
    keep = len(final.lstrip()) if text[at:at + len(final.lstrip())] == final.lstrip() else len(final.strip())
    return text[:at + keep]
