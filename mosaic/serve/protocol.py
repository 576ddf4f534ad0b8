"""Request bodies of the OpenAI-compatible endpoints (pydantic), with Mosaic's extra fields.

Lenient where clients are, as vLLM is:
- a field this server does not know is accepted and reported, never a 400: `ignored()` lists it
  (the response's `mosaic.ignored`, with the reason; the app logs each name once). A field inside
  a message is the exception: it may carry content, so an unknown one is still refused;
- `null` for an optional field is the same as leaving it out (`n`, `stream`, `echo`, ...);
- numbers are read as pydantic's lax mode reads them: "8" and 8.0 are the integer 8, "0.7" is
  0.7; 8.5 for an integer, or a boolean for a number, is still a 400.

Strict where it matters: OpenAI options that a diffusion sampler cannot honour are accepted only
at their neutral values (n=1, penalties 0, no logprobs, no logit_bias, no echo, no suffix), the
legacy function-calling history (a `function` message, an assistant `function_call`) is refused
with the current names (`tool_refusal`; assistant `tool_calls` and `tool` messages are read:
serve/structured.history), and every sampler option is checked by the engine. Output
constraints (response_format, vLLM's guided_* / structured_outputs) and forced tool calls are read
by serve/structured.py."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, StrictStr, create_model, model_validator

from ..chat_template import ChatOptions
from ..config import OPTIONS

# GenerationConfig fields a request may set besides max_tokens / temperature / top_p / seed
# GenerationConfig's options (declared once, config/generation.py) that have no OpenAI name of
# their own: each is a request field of its declared type (the engine checks its value)
OPENAI_NAMED = frozenset({"max_new_tokens", "temperature", "seed", "top_p"})
SAMPLER_FIELDS = tuple(n for n in OPTIONS if n not in OPENAI_NAMED)
ROLES = ("system", "user", "assistant", "developer", "tool")   # developer = system (OpenAI's newer name)
TOOL_WORDS = ("legacy function calling is not read: send the call as the assistant's tool_calls and its result as "
              "a message of role 'tool' with the call's tool_call_id (OpenAI's current names)")
# why a field clients often send is ignored (any other unknown field: UNKNOWN)
REASONS = {
    "parallel_tool_calls": "one tool call per answer",
    "functions": "no function calling: the model answers in text",
    "function_call": "no function calling: the model answers in text",
    "stream_options.continuous_usage_stats": "usage is sent once, in the chunk after the last one "
                                             "(stream_options.include_usage)",
    "top_logprobs": "no logprobs",
    "ignore_eos": "the canvas is always max_tokens long; the answer still ends at its first end-of-text",
    "store": "nothing is stored",
    "metadata": "nothing is stored",
    "user": "an end-user id: not used",
    "service_tier": "one tier",
    "prompt_cache_key": "no prompt cache",
    "safety_identifier": "not used",
    "reasoning_effort": "not a reasoning model",
    "modalities": "text only",
    "prediction": "no predicted outputs",
    "web_search_options": "no web search",
    "audio": "text only",
}
UNKNOWN = "not a field of this server"
TOOLS, CONTENT_TYPE = "tools_unsupported", "content_type_unsupported"   # the codes of tool_refusal


def _number(value):
    """Before a number field: a boolean is not a number (pydantic's lax mode would read true as 1)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


Int = Annotated[int, BeforeValidator(_number)]       # 8, "8", 8.0; not 8.5, not true
Float = Annotated[float, BeforeValidator(_number)]   # 0.7, "0.7", 1; not true


class Lenient(BaseModel):
    """Unknown fields kept aside (model_extra) for ignored(); null = unset for optional fields."""
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):
        if isinstance(data, dict):
            required = {n for n, f in cls.model_fields.items() if f.is_required()}
            return {k: v for k, v in data.items() if v is not None or k in required}
        return data

    def extras(self, prefix: str = "") -> list[str]:
        """Dotted paths of the unknown fields here and in the nested lenient objects."""
        out = [prefix + k for k in (self.model_extra or {})]
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                if isinstance(item, (Lenient, Message)):
                    at = f"{name}.{i}." if isinstance(value, list) else f"{name}."
                    out += item.extras(prefix + at)
        return out


class StreamOptions(Lenient):
    include_usage: bool = False


_KINDS = {int: Int, float: Float, str: StrictStr, bool: bool}
# the sampler options as pydantic fields, derived from their Option declarations
SamplerOptions = create_model("SamplerOptions", __base__=Lenient,
                              **{n: (_KINDS[OPTIONS[n].kind] | None, None) for n in SAMPLER_FIELDS})


class Sampling(SamplerOptions):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: StrictStr | None = None
    max_tokens: Int | None = Field(None, description="the canvas length (max_new_tokens)")
    temperature: Float | None = None
    top_p: Float | None = None
    n: Int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: Int | None = Field(None, ge=-2**63, lt=2**64, description="-1: a random seed (reported); another "
                             "negative seed is its 64-bit two's complement")
    presence_penalty: Float = 0
    frequency_penalty: Float = 0
    logprobs: bool | Int | None = None
    logit_bias: dict | None = None
    # vLLM's extras: stop ids and stop strings kept in the answer are honoured; min_tokens and
    # repetition_penalty only at their neutral values (a diffusion canvas has no token order to
    # hold an end-of-text back or to penalise repeats in)
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: Int = 0
    repetition_penalty: Float = 1.0
    # Mosaic: the sampler options of each family come from SamplerOptions (config/generation.py)
    mask_ratio: Float | None = Field(None, description="share of prompt + canvas generated (0, 1)")
    # output constraints (serve/structured.py; docs/STRUCTURED.md)
    response_format: dict | None = None
    guided_json: dict | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: dict | None = None
    stream_canvas: bool = False
    return_token_ids: bool = False

    def unsupported(self) -> tuple[str, str] | None:
        """(message, field) of the first option set to something this server does not do."""
        checks = [
            (self.n != 1, "n", f"n={self.n}: one choice per request (send several requests)"),
            (bool(self.presence_penalty or self.frequency_penalty), "presence_penalty",
             "presence_penalty / frequency_penalty are not supported by diffusion sampling (use 0)"),
            (bool(self.logprobs), "logprobs", "logprobs are not supported"),
            (bool(self.logit_bias), "logit_bias", "logit_bias is not supported"),
            (self.min_tokens != 0, "min_tokens", f"min_tokens={self.min_tokens} is not supported: the canvas is "
             "denoised whole and its answer ends at the first end-of-text the model commits (use 0)"),
            (self.repetition_penalty != 1, "repetition_penalty", f"repetition_penalty={self.repetition_penalty} is "
             "not supported: every position is predicted at once, there is no earlier output to penalise (use 1)"),
            (self.stream_options is not None and not self.stream, "stream_options",
             "stream_options can only be given with stream: true"),
            # checked on every family, also where the sampler then ignores them (vLLM refuses them too)
            (self.top_p is not None and not 0 < self.top_p <= 1, "top_p",
             f"top_p={self.top_p} must be in (0, 1] (the probability mass kept; 1 keeps every token)"),
            (self.top_k is not None and self.top_k < -1, "top_k",
             f"top_k={self.top_k} must be at least 1, or -1 / 0 for no top-k filter (as in vLLM)"),
        ]
        return next(((why, name) for bad, name, why in checks if bad), None)

    def seed_value(self) -> int | None:
        """The seed to run with: None (a random one, reported) for no seed or -1 (llama.cpp's
        "random"); another negative seed as its 64-bit two's complement (vLLM takes any 64-bit
        signed seed)."""
        if self.seed is None or self.seed == -1:
            return None
        return self.seed + 2**64 if self.seed < 0 else self.seed

    def canvas(self) -> tuple[int | None, str]:
        """The requested canvas length and the field it came from (chat: max_completion_tokens
        wins over max_tokens, as in vLLM)."""
        return self.max_tokens, "max_tokens"

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops) or len(stops) > 16:
            raise ValueError("stop: up to 16 non-empty strings")
        return stops

    def ignored(self, sampler_options: frozenset, family: str) -> dict[str, str]:
        """{field path: why} for every field given that changes nothing: unknown fields, and
        top_p / top_k on a family whose sampler has no such filter (LLaDA draws from the whole
        distribution; a 400 there would break clients that send top_p by default)."""
        out = {p: REASONS.get(p, UNKNOWN) for p in self.extras()}
        for name in ("top_p", "top_k"):
            value = getattr(self, name)
            neutral = value == 1 if name == "top_p" else value in (-1, 0)    # no filter at all
            if name not in sampler_options and value is not None and not neutral:
                out[name] = f"the {family} sampler has no {name.replace('_', '-')} filter (it reads every token's "\
                            "probability); the tokens are those without it"
        return out

    def options(self, sampler_options: frozenset) -> dict:
        """Generation options for MosaicEngine.generation_config (None = the model's default);
        top_p / top_k only where the family's sampler reads them (ignored() says so otherwise)."""
        opts = {k: getattr(self, k) for k in SAMPLER_FIELDS if k != "top_k" or k in sampler_options}
        if opts.get("top_k") in (-1, 0):     # vLLM's "no top-k filter"
            opts["top_k"] = None
        canvas, _ = self.canvas()
        opts |= {"max_new_tokens": canvas, "temperature": self.temperature, "seed": self.seed_value()}
        if "top_p" in sampler_options:   # top_p = 1 keeps every token: the same as no top-p
            opts["top_p"] = None if self.top_p == 1 else self.top_p
        return {k: v for k, v in opts.items() if v is not None}


class CompletionRequest(Sampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: bool = False
    suffix: StrictStr | None = None
    best_of: Int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo is not supported", "echo"
        if self.suffix:
            return "suffix (infilling) is not supported", "suffix"
        if self.best_of not in (None, 1):
            return "best_of is not supported", "best_of"
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int) \
                and len(self.prompt) != 1:
            return (f"{len(self.prompt)} prompts in one request: send one prompt per request (each runs "
                    "alone, so each gets exactly its own tokens)"), "prompt"
        return super().unsupported()

    def the_prompt(self):
        """The one prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return p[0]
        return p


class ContentPart(Lenient):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    """The function of a tool call sent back: its name and its arguments as JSON text."""
    name: StrictStr
    arguments: StrictStr


class ToolCall(BaseModel):
    """A tool call of an earlier assistant turn, as the server returned it (OpenAI's shape)."""
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """One chat message. An unknown field is refused (it may carry content); null fields are
    unset; an assistant turn's content may be null or missing (an empty turn, as after a tool
    call). An assistant turn may carry the tool_calls it made, a `tool` message the result of
    one of them (tool_call_id); serve/structured.history renders them."""
    model_config = ConfigDict(extra="forbid")
    role: Literal[ROLES]
    content: StrictStr | list[ContentPart]
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):
        if isinstance(data, dict):   # tool_calls: [] (no calls) is what some clients send back
            data = {k: v for k, v in data.items() if v is not None and not (k == "tool_calls" and v == [])}
            if data.get("role") == "assistant":
                data.setdefault("content", "")
        return data

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to an assistant message, not a {self.role!r} one")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a 'tool' message needs the tool_call_id of the call it answers" if self.role == "tool"
                             else f"tool_call_id belongs to a 'tool' message, not a {self.role!r} one")
        return self

    def text(self) -> str:
        """The content as text: text parts joined by newlines (as vLLM joins them)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)

    def extras(self, prefix: str = "") -> list[str]:
        parts = self.content if isinstance(self.content, list) else []
        return [p for i, part in enumerate(parts) for p in part.extras(f"{prefix}content.{i}.")]


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Int | None = None
    tools: list[dict] | None = None
    tool_choice: StrictStr | dict | None = None
    # how the chat template renders the messages (vLLM's fields; chat_template.ChatOptions)
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None

    def template(self) -> ChatOptions:
        """The rendering options (InputError: add_generation_prompt and continue_final_message both true)."""
        return ChatOptions(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs or {})

    def canvas(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def chat(self) -> list[dict]:
        """The messages as dicts: role (developer as system), content as text, and an assistant's
        tool_calls / a tool message's tool_call_id where given (serve/structured.history)."""
        out = []
        for m in self.messages:
            d = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        return out


def tool_refusal(body: dict) -> tuple[str, str, str] | None:
    """(message, param, code) when a chat body carries the legacy function-calling history, which
    this server does not read (code TOOLS): a `function` message, an assistant `function_call`.
    Text parts only: another content part type (an image, audio) is refused
    too, with its own code (CONTENT_TYPE). Checked on the raw body, before validation, so the
    message names the feature rather than a schema mismatch."""
    messages = body.get("messages")
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        if not isinstance(m, dict):
            continue
        if m.get("role") == "function":
            return f"messages.{i}: a 'function' message: {TOOL_WORDS}", f"messages.{i}.role", TOOLS
        if m.get("function_call"):
            return f"messages.{i}.function_call: {TOOL_WORDS}", f"messages.{i}.function_call", TOOLS
        content = m.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind != "text":
                return (f"messages.{i}.content.{j}: content parts of type {kind!r} are not supported: this "
                        "model reads text only; send the content as a string or as parts of type 'text'"), \
                    f"messages.{i}.content.{j}", CONTENT_TYPE
    return None
