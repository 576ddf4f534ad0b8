"""Request bodies of the OpenAI-compatible endpoints (pydantic), with Mosaic's extra fields.

Unknown fields are refused (400), not ignored: a client that asks for something this server
does not do is told so. OpenAI fields that a diffusion sampler has no use for are accepted only
at their neutral values (n=1, penalties 0, no logprobs, no logit_bias, no echo, no suffix)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictInt | StrictFloat

# GenerationConfig fields a request may set besides max_tokens / temperature / top_p / seed
SAMPLER_FIELDS = ("steps", "block_length", "cfg_scale", "remasking", "confidence_dtype", "logits_eos_inf",
                  "confidence_eos_eot_inf", "alg", "alg_temp", "top_k", "eps")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, description="the canvas length (max_new_tokens)")
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    user: StrictStr | None = None
    presence_penalty: Number = 0
    frequency_penalty: Number = 0
    logprobs: StrictBool | StrictInt | None = None
    logit_bias: dict | None = None
    # Mosaic: the sampler options of each family (GenerationConfig fields; the engine checks them)
    steps: StrictInt | None = None
    block_length: StrictInt | None = None
    cfg_scale: Number | None = None
    remasking: StrictStr | None = None
    confidence_dtype: StrictStr | None = None
    logits_eos_inf: StrictBool | None = None
    confidence_eos_eot_inf: StrictBool | None = None
    alg: StrictStr | None = None
    alg_temp: Number | None = None
    top_k: StrictInt | None = None
    eps: Number | None = None
    mask_ratio: Number | None = Field(None, description="share of prompt + canvas generated (0, 1)")
    stream_canvas: StrictBool = False
    return_token_ids: StrictBool = False

    def unsupported(self) -> str | None:
        """The first OpenAI option set to something this server does not do, as a message."""
        if self.n != 1:
            return f"n={self.n}: one choice per request (send several requests)"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty / frequency_penalty are not supported by diffusion sampling (use 0)"
        if self.logprobs:
            return "logprobs are not supported"
        if self.logit_bias:
            return "logit_bias is not supported"
        return None

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops) or len(stops) > 16:
            raise ValueError("stop: up to 16 non-empty strings")
        return stops

    def options(self) -> dict:
        """Generation options for MosaicEngine.generation_config (None = the model's default)."""
        opts = {k: getattr(self, k) for k in SAMPLER_FIELDS}
        opts |= {"max_new_tokens": self.max_tokens, "temperature": self.temperature, "seed": self.seed,
                 # top_p = 1 keeps every token: the same as no top-p (for Dream, and a no-op for LLaDA)
                 "top_p": None if self.top_p == 1 else self.top_p}
        return {k: v for k, v in opts.items() if v is not None}


class CompletionRequest(Sampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo is not supported"
        if self.suffix:
            return "suffix (infilling) is not supported"
        if self.best_of not in (None, 1):
            return "best_of is not supported"
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int) \
                and len(self.prompt) != 1:
            return (f"{len(self.prompt)} prompts in one request: send one prompt per request (each runs "
                    "alone, so each gets exactly its own tokens)")
        return super().unsupported()

    def the_prompt(self):
        """The one prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return p[0]
        return p


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: StrictStr | list[ContentPart]
    name: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None

    def options(self) -> dict:
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return super().options()

    def chat(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
