"""One request from its body to its answer: admission, the job on the engine worker, and the
response: a JSON body, or server-sent events that carry text as it is committed (the generated
prefix up to the first still-masked position, final once unmasked; a step that commits nothing
sends nothing). A client that goes away, or a request past --request-timeout, cancels its job:
the engine stops after the op it is running (an eager step asks after every op) and the request's memory is released."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse

from ..errors import gib
from .api_errors import ApiError, error_of, parse
from .structured import tool_calls
from .worker import Job, JobResult, StepEvent

log = logging.getLogger("mosaic.serve")

DISCONNECT_POLL_S = 0.2   # how often a waiting non-streaming request checks its client is still there


def timed_out(seconds: float) -> ApiError:
    # x-should-retry: the openai SDK would otherwise retry a 504 (twice, by default)
    return ApiError(504, f"the request did not finish within the server's --request-timeout of {seconds:g} s; "
                    "it was cancelled", "timeout", "request_timeout", headers={"x-should-retry": "false"})


async def handle(server, request: Request, model, chat: bool):  # noqa: C901
    """The route of /v1/completions (chat False) and /v1/chat/completions (chat True)."""
    t0 = time.perf_counter()
    if server.closing:
        raise ApiError(503, "the server is shutting down", "server_error", "shutting_down")
    req = await parse(request, model)
    if req.model not in (None, "", server.name):     # "": the served model (vLLM reads it so)
        raise ApiError(404, f"model {req.model!r} is not served here; this server serves {server.name!r}",
                       "not_found_error", "model_not_found", "model")
    refused = req.unsupported()
    if refused:
        raise ApiError(400, refused[0], param=refused[1])
    adm = await run_in_threadpool(server.admit, req, chat)
    server.warn_ignored(adm.ignored)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def emit(kind, payload):   # from the worker thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
        except RuntimeError:   # the loop is closed (shutdown): nobody is waiting
            pass
    job = Job(adm.prompt_ids, adm.gen, emit, adm.stop, stop_ids=adm.stop_ids, want_canvas=req.stream_canvas,
              want_steps=req.stream, predicted_bytes=adm.predicted_bytes, admission_seconds=adm.seconds,
              request=adm.request, admission=adm.admission)
    if not server.submit(job):
        raise ApiError(503, f"the queue is full ({server.worker.max_queue} requests waiting); retry later",
                       "server_busy", "queue_full", headers={"Retry-After": str(server.retry_after())})
    deadline = None if server.request_timeout is None else t0 + server.request_timeout
    reply = Reply(server, job, adm, chat, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                  req.include_stop_str_in_output)
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(reply.sse(events, usage, deadline), media_type="text/event-stream")
    result = await collect(reply, events, request, deadline)
    if result is None:   # the client went away: uvicorn logs nothing for a response nobody receives
        log.info('%s - "%s %s" 499 (the client went away; request cancelled)', _client(request), request.method,
                 request.url.path)
        return Response(status_code=499)
    overhead = max(0.0, time.perf_counter() - t0 - result.queue_seconds - result.engine_seconds)
    server.metrics.overhead.observe(overhead)
    text = result.text + reply.kept_stop(result)
    choice = {"index": 0, "finish_reason": result.finish_reason, "stop_reason": result.stop_reason, "logprobs": None}
    choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    if adm.tool_call:       # the answer is a call of one of the tools (serve/structured.py)
        choice |= {"finish_reason": "tool_calls", "message": {"role": "assistant", "content": None,
                                                              "tool_calls": reply.calls(result)}}
    mosaic = reply.mosaic(result, overhead)
    if req.return_token_ids:
        mosaic |= {"prompt_token_ids": adm.prompt_ids, "token_ids": result.token_ids}
    return reply.head() | {"choices": [choice], "usage": usage_of(result), "mosaic": mosaic}


async def collect(reply: Reply, events: asyncio.Queue, request: Request, deadline: float | None) -> JobResult | None:
    """Wait for the job's end, cancelling it if the client disconnects meanwhile (checked every
    DISCONNECT_POLL_S seconds, step events or not) or the deadline passes (504)."""
    checked = time.perf_counter()
    while True:
        try:
            kind, payload = await asyncio.wait_for(events.get(), timeout=DISCONNECT_POLL_S)
        except TimeoutError:
            kind, payload = None, None
        if kind == "done":
            return payload
        if kind == "error":
            raise reply.error(payload)
        now = time.perf_counter()
        if deadline is not None and now > deadline:
            reply.job.cancel()
            raise timed_out(reply.server.request_timeout)
        if now - checked >= DISCONNECT_POLL_S:
            checked = now
            if await request.is_disconnected():
                reply.job.cancel()
                return None


def _client(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "-"


def usage_of(r: JobResult) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens}


def _event(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Reply:
    """What one admitted request answers: the response's head, the mosaic object, errors in the
    request's own lengths, and its event stream."""

    def __init__(self, server, job: Job, adm, chat: bool, rid: str, keep_stop: bool = False):
        self.server, self.job, self.adm, self.chat, self.id = server, job, adm, chat, rid
        self.keep_stop = keep_stop       # vLLM's include_stop_str_in_output
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())

    def head(self, chunk: bool = False) -> dict:
        obj = f"{self.object}.chunk" if chunk and self.chat else self.object
        return {"id": self.id, "object": obj, "created": self.created, "model": self.server.name,
                "system_fingerprint": self.server.fingerprint}

    def kept_stop(self, r: JobResult) -> str:
        """The stop string that ended the answer when the request keeps it (include_stop_str_in_output)."""
        return r.stop_reason if self.keep_stop and isinstance(r.stop_reason, str) else ""

    def error(self, exc) -> ApiError:
        return error_of(exc, len(self.adm.prompt_ids), self.adm.gen.max_new_tokens, self.server.closing)

    def mosaic(self, r: JobResult, overhead: float | None = None) -> dict:
        job = self.job
        out = {"canvas_tokens": r.canvas_tokens, "steps": r.steps, "steps_run": r.steps_run,
               "stopped_early": r.stopped_early, "path": r.path, "lossy": r.lossy, "stats": r.stats,
               "ignored": self.adm.ignored, "seed": r.seed, "engine_seconds": r.engine_seconds,
               "queue_seconds": r.queue_seconds, "admission_seconds": job.admission_seconds,
               "predicted_bytes": job.predicted_bytes,
               "predicted": gib(job.predicted_bytes) if job.predicted_bytes else None,
               "beyond_trained_length": bool(self.adm.request is not None and self.adm.request.beyond_trained_length)}
        if overhead is not None:
            out["server_seconds"] = overhead
        return out

    def calls(self, r: JobResult) -> list[dict]:
        """The tool_calls of a tool-constrained answer (a 500 if it does not parse: a bug)."""
        return tool_calls(r.text)

    def chunk(self, delta: str | None, finish=None, extra=None, stop_reason=None) -> dict:
        if self.chat:
            c = {"index": 0, "delta": {} if delta is None else {"content": delta}, "finish_reason": finish,
                 "logprobs": None}
        else:
            c = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        if finish is not None:
            c["stop_reason"] = stop_reason
        out = self.head(chunk=True) | {"choices": [c]}
        if extra is not None:
            out["mosaic"] = extra
        return out

    async def sse(self, events: asyncio.Queue, usage: bool, deadline: float | None):  # noqa: C901
        """Server-sent events: chat's first chunk (the role); a chunk for each step that commits
        text (with stream_canvas, every step: the canvas is the point); a last chunk with
        finish_reason and the mosaic summary; a usage chunk if asked; [DONE]. A client that goes
        away cancels the job (the generator is closed), and so does the deadline."""
        done = False
        try:
            if self.chat:
                first = self.chunk(None)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield _event(first)
            while True:
                try:
                    timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
                    what, payload = await asyncio.wait_for(events.get(), timeout)
                except TimeoutError:
                    self.job.cancel()
                    done = True
                    yield _event({"error": timed_out(self.server.request_timeout).body()})
                    yield "data: [DONE]\n\n"
                    return
                if what == "step":
                    ev: StepEvent = payload
                    if (not ev.delta and ev.canvas is None) or self.adm.tool_call:   # a call comes whole
                        continue
                    extra = {"step": ev.step, "steps": ev.steps, "masked": ev.masked}
                    if ev.canvas is not None:
                        extra["canvas"] = ev.canvas
                    yield _event(self.chunk(ev.delta, extra=extra))
                elif what == "done":
                    done = True
                    r: JobResult = payload
                    finish = r.finish_reason
                    if self.adm.tool_call:
                        calls = [c | {"index": i} for i, c in enumerate(self.calls(r))]
                        call = self.chunk(None)
                        call["choices"][0]["delta"] = {"tool_calls": calls}
                        yield _event(call)
                        finish = "tool_calls"
                    kept = self.kept_stop(r)
                    yield _event(self.chunk(kept or ("" if not self.chat else None), finish, self.mosaic(r),
                                            r.stop_reason))
                    if usage:
                        yield _event(self.head(chunk=True) | {"choices": [], "usage": usage_of(r)})
                    yield "data: [DONE]\n\n"
                    return
                else:
                    done = True
                    yield _event({"error": self.error(payload).body()})
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not done:
                self.job.cancel()
