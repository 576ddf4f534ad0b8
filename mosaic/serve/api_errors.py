"""What the server says when a request is wrong: parsing and validation of the body into one
line per wrong field (in the API's own words), the OpenAI error shape, and the HTTP status of
each engine error (400 bad input, 400 `context_length_exceeded` over the memory budget or
max_seq_len, 499 cancelled, 500 a failure)."""

from __future__ import annotations

import json
import re

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ..config import OPTIONS
from ..errors import MemoryBudgetError, MosaicError
from .protocol import ROLES, tool_refusal
from .worker import Cancelled

EXPECTED = {"prompt": "a string, a list of token ids, or a list holding one of those",
            "stop": "a string or a list of strings", "messages": "a non-empty list of {role, content}"}
# the engine's names of the canvas length, and the API's (max_tokens is max_new_tokens)
ENGINE_WORDS = re.compile(r"\b(max_new_tokens|gen_length)\b")
# an engine message that begins with a field's name ("steps 8 must be ...", "mask_ratio=2 must be ...")
LEADING_NAME = re.compile(r"([a-z_]+)(?=[ =:])")
CANVAS_NAMES = frozenset({"max_new_tokens", "gen_length"})
HTTP_TYPES = {404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed")}


def api_words(message: str) -> str:
    """An engine message in the request's own words: max_tokens for max_new_tokens / gen_length."""
    return ENGINE_WORDS.sub("max_tokens", message)


def param_of(exc, canvas_field: str = "max_tokens") -> str | None:
    """The request field an engine error is about, in the API's names (max_new_tokens and
    gen_length are `canvas_field`): the InputError's own `param` where the check set it
    (config/generation.py's option checks), else the option its message begins with (a family
    sampler's checks: "steps 8 must be ...", "top_k must be ..."), else None."""
    name = getattr(exc, "param", None)
    if name is None:
        m = LEADING_NAME.match(str(exc))
        name = m.group(1) if m and (m.group(1) in OPTIONS or m.group(1) in CANVAS_NAMES | {"mask_ratio"}) else None
    return canvas_field if name in CANVAS_NAMES else name


class ApiError(Exception):
    """An answer other than 200: HTTP status, message, OpenAI error type and extra fields."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None, **extra):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param, self.extra = \
            status, message, type_, code, param, extra
        self.headers = headers or {}

    def body(self) -> dict:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code, **self.extra}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.body()}, status_code=self.status, headers=self.headers)


def context_overflow(limit: int, prompt_tokens: int, canvas: int, reason: str, detail: str, param: str | None = None,
                     **extra) -> ApiError:
    """A request longer than what fits: 400 with OpenAI's code `context_length_exceeded` and vLLM's
    message (litellm maps it to ContextWindowExceededError, LangChain and others match the words),
    then Mosaic's reason. limit: the longest prompt + max_tokens that fits (for a refusal by the
    memory budget, of this request's shape); reason: 'memory_budget' or 'max_seq_len'."""
    total = prompt_tokens + canvas
    message = (f"This model's maximum context length is {limit} tokens. However, you requested {total} tokens "
               f"({prompt_tokens} in the messages, {canvas} in the completion). Please reduce the length of the "
               f"messages or completion. (Mosaic, {reason}: {detail})")
    return ApiError(400, message, "invalid_request_error", "context_length_exceeded", param, reason=reason,
                    prompt_tokens=prompt_tokens, requested_tokens=total, max_tokens=limit,
                    max_new_tokens=max(0, limit - prompt_tokens), **extra)


async def parse(request: Request, model):
    """The request's body as `model` (ApiError 400 otherwise). JSON decoding and validation run
    on a thread of the pool: a body of megabytes never holds up the event loop (other clients,
    /health)."""
    body = await request.body()
    return await run_in_threadpool(parse_body, body, model)


def parse_body(body: bytes, model):
    """parse() off the event loop: bytes -> the validated request (ApiError 400)."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(obj).__name__}")
    refused = tool_refusal(obj) if "messages" in model.model_fields else None
    if refused:
        raise ApiError(400, refused[0], param=refused[1], code=refused[2])
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise ApiError(400, validation_message(e), param=_field(e.errors()[0])) from None


def _field(err) -> str:
    """The field's path: its name, or list item and field (messages.0.role), without the union
    alternative pydantic appends (prompt.str)."""
    loc = err["loc"]
    if not loc:
        return "body"
    item = len(loc) > 1 and isinstance(loc[1], int)
    return ".".join(str(p) for p in loc[:3]) if item else str(loc[0])


def validation_message(e: ValidationError) -> str:
    """One line per wrong field (a union's alternatives folded into what is expected); a field of
    a list item is named by its path (messages.0.content)."""
    seen, parts = set(), []
    for err in e.errors():
        loc = err["loc"]
        top = str(loc[0]) if loc else "body"
        item = len(loc) > 1 and isinstance(loc[1], int)   # in an item of a list: messages.0.role
        where = _field(err)
        if where in seen:
            continue
        seen.add(where)
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown field {where!r} (docs/SERVING.md lists the fields)")
        elif err["type"] == "missing":
            parts.append(f"missing field {where!r}")
        elif top == "messages" and item and loc[2:3] == ("role",):
            parts.append(f"{where}: invalid role {err.get('input')!r}; allowed roles: {', '.join(ROLES)}")
        elif top == "messages" and item and loc[2:3] == ("content",):
            parts.append(f"{where}: expected a string or a list of {{\"type\": \"text\", \"text\": ...}} parts")
        elif item:
            parts.append(f"{where}: {err['msg'].lower()} (got {err.get('input')!r})")
        elif top in EXPECTED:
            parts.append(f"{top}: expected {EXPECTED[top]}")
        else:
            parts.append(f"{where}: {err['msg'].lower()} (got {err.get('input')!r})")
    return "; ".join(parts)


def error_of(exc, prompt_tokens: int = 0, canvas: int = 0, closing: bool = False) -> ApiError:
    """The answer to an engine error that ended a request (prompt_tokens, canvas: its lengths;
    closing: the server is shutting down, which cancelled it)."""
    if isinstance(exc, Cancelled):
        if closing:
            return ApiError(503, f"the server is shutting down: {exc}", "server_error", "shutting_down")
        return ApiError(499, str(exc), "cancelled")
    if isinstance(exc, MemoryBudgetError):
        return context_overflow(exc.max_tokens or 0, prompt_tokens, canvas, "memory_budget", str(exc),
                                needed_bytes=exc.needed_bytes, available_bytes=exc.budget_bytes)
    if isinstance(exc, MosaicError):
        return ApiError(400, api_words(str(exc)), param=param_of(exc))
    return ApiError(500, f"the engine failed: {type(exc).__name__}: {exc}", "server_error")
