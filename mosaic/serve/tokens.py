"""vLLM's /tokenize and /detokenize: the served model's tokenizer (and chat template) over HTTP,
so a client can count a prompt's tokens against max_model_len before sending it.

POST /tokenize {"prompt": text, "add_special_tokens": true} or {"messages": [...],
"add_generation_prompt", "continue_final_message", "chat_template_kwargs", "add_special_tokens":
false} (+ "return_token_strs") -> {"count", "max_model_len", "tokens", "token_strs"};
POST /detokenize {"tokens": [ids]} -> {"prompt": text}. Token ids outside the vocabulary, text
the tokenizer cannot encode and a model without a tokenizer are 400s."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from pydantic import StrictInt, StrictStr

from ..errors import MosaicError
from .api_errors import ApiError, api_words, param_of, parse, parse_body
from .protocol import ChatRequest, Lenient


class TokenizeText(Lenient):
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(ChatRequest):
    add_special_tokens: bool = False
    return_token_strs: bool = False


class Detokenize(Lenient):
    model: StrictStr | None = None
    tokens: list[StrictInt]


def _has_messages(body: bytes) -> bool:
    """Whether a /tokenize body is a chat request (it has messages); a body that is not a JSON
    object is left to the parser's 400."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(obj, dict) and "messages" in obj


def add_token_routes(app, server) -> None:
    """/tokenize and /detokenize on `app` over the Server's engine."""
    engine = server.engine

    def check_model(req) -> None:
        if req.model not in (None, "", server.name):
            raise ApiError(404, f"model {req.model!r} is not served here; this server serves {server.name!r}",
                           "not_found_error", "model_not_found", "model")

    def tokenizer():
        tok = engine.model.tokenizer
        if tok is None:
            raise ApiError(400, f"model {server.name} has no tokenizer.json: it reads token ids only")
        return tok

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.body()
        chat = _has_messages(body)
        req = await run_in_threadpool(parse_body, body, TokenizeChat if chat else TokenizeText)
        check_model(req)
        tok = tokenizer()
        try:
            if chat:   # the template writes its own BOS; add_special_tokens adds the tokenizer's again, as HF does
                ids = engine.encode(req.chat(), chat=True, template=req.template())[0]
                ids = [tok.bos_id] + ids if req.add_special_tokens and tok.add_bos else ids
            else:
                ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        except MosaicError as e:
            raise ApiError(400, api_words(str(e)), param=param_of(e) or ("messages" if chat else "prompt")) from None
        strs = [tok.tok.id_to_token(i) for i in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await parse(request, Detokenize)
        check_model(req)
        vocab = engine.model.cfg.vocab
        bad = [i for i in req.tokens if not 0 <= i < vocab]
        if bad:
            raise ApiError(400, f"token ids {bad[:8]} are outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": tokenizer().decode(req.tokens, skip_special_tokens=False)}
