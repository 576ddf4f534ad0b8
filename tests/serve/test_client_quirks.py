"""What common OpenAI clients send and expect, one test per quirk, against the server
on 127.0.0.1 with the bundled tiny-llada: unknown fields, nulls, lax numbers, context overflow,
top_p / top_k on LLaDA, roles and content parts, tools refused, ids, Retry-After, models by id,
max_model_len, max_completion_tokens, eos lists, committed-text streams, lossy labels."""

import dataclasses
import logging
import re
import threading
import time

import pytest
from serving import PAST_TRAINED, budgeted_engine, events, httpx

from mosaic import MosaicEngine
from mosaic.runtime.samplers.dream import DreamSampler
from mosaic.serve.protocol import ChatRequest, CompletionRequest
from mosaic.serve.server import ServerThread

SORT = {"prompt": "sort 31415926=", "max_tokens": 8, "steps": 8}
CHAT = {"messages": [{"role": "user", "content": "sort 4321="}], "max_tokens": 8, "steps": 8}
LONG = {"prompt": "sort 31415926=", "max_tokens": 96, "steps": 96}   # ~1-3 s on the CPU


@pytest.fixture(scope="module")
def server():
    with ServerThread(budgeted_engine(), max_model_len=PAST_TRAINED, timeout=60) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_unknown_fields_are_accepted_listed_and_logged_once(client, caplog):
    extra = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "none",
             "store": False, "top_logprobs": 2, "logprobs": False,
             "parallel_tool_calls": False, "user": "u1", "metadata": {"a": "b"}, "service_tier": "auto",
             "colour": "red"}     # (stream_options without stream is a 400, as in vLLM: test_vllm_surface.py)
    with caplog.at_level(logging.WARNING, logger="mosaic.serve"):
        for _ in range(2):
            r = client.post("/v1/chat/completions", json=CHAT | extra)
            assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "1234"
    ignored = body["mosaic"]["ignored"]
    assert set(ignored) == {"tool_choice", "store", "top_logprobs", "parallel_tool_calls", "user", "metadata",
                            "service_tier", "colour"}
    assert "not offered" in ignored["tool_choice"] and ignored["colour"] == "not a field of this server"
    logged = [rec.getMessage() for rec in caplog.records if "ignoring request field" in rec.getMessage()]
    assert sum("'tool_choice'" in m for m in logged) == 1 and sum("'colour'" in m for m in logged) <= 1
    # a completion: the same, and nothing ignored when nothing unknown is sent
    assert "colour" in client.post("/v1/completions", json=SORT | {"colour": 1}).json()["mosaic"]["ignored"]
    assert client.post("/v1/completions", json=SORT).json()["mosaic"]["ignored"] == {}


def test_null_is_unset_and_numbers_are_lax(client):
    nulls = {k: None for k in ("n", "stream", "presence_penalty", "frequency_penalty", "echo", "temperature",
                               "seed", "stop", "top_p", "logprobs", "logit_bias", "suffix", "best_of", "user")}
    r = client.post("/v1/completions", json=SORT | nulls | {"stream_options": None})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "11234569", r.text
    lax = client.post("/v1/completions", json={"prompt": "sort 31415926=", "max_tokens": "8", "steps": 8.0,
                                               "temperature": "0", "n": "1", "stream": "false"})
    assert lax.status_code == 200 and lax.json()["choices"][0]["text"] == "11234569", lax.text
    for bad in ({"max_tokens": 8.5}, {"max_tokens": True}, {"steps": "eight"}, {"stream": "maybe"}):
        r = client.post("/v1/completions", json=SORT | bad)
        field = next(iter(bad))
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": None}]})
    assert r.status_code == 400 and "missing field 'messages.0.content'" in r.json()["error"]["message"]


def test_context_overflow_is_openais_400_in_vllms_words(client):
    r = client.post("/v1/chat/completions", json=CHAT | {"max_tokens": 2048})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"
    assert err["param"] == "messages" and err["reason"] == "memory_budget"
    P = err["prompt_tokens"]
    m = re.match(r"This model's maximum context length is (\d+) tokens\. However, you requested (\d+) tokens "
                 r"\((\d+) in the messages, (\d+) in the completion\)\. Please reduce the length of the messages "
                 r"or completion\.", err["message"])
    assert m, err["message"]
    assert [int(g) for g in m.groups()] == [err["max_tokens"], P + 2048, P, 2048]
    ok = client.post("/v1/chat/completions", json=CHAT | {"max_tokens": err["max_new_tokens"], "steps": 1})
    assert ok.status_code == 200, ok.text      # the longest that fits, as the body says


def test_top_p_and_top_k_on_llada_are_ignored_and_labelled(client):
    plain = client.post("/v1/completions", json=SORT | {"temperature": 1.0, "seed": 3}).json()
    r = client.post("/v1/completions", json=SORT | {"temperature": 1.0, "seed": 3, "top_p": 0.9, "top_k": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == plain["choices"][0]["text"]     # the same draw: nothing applied
    ignored = body["mosaic"]["ignored"]
    assert set(ignored) == {"top_p", "top_k"} and "LLaDA sampler has no top-p filter" in ignored["top_p"]
    # top_p = 1 is no filter at all: nothing to label
    assert client.post("/v1/completions", json=SORT | {"top_p": 1}).json()["mosaic"]["ignored"] == {}


def test_dream_reads_top_p_and_top_k():
    req = CompletionRequest.model_validate({"prompt": "x", "top_p": 0.9, "top_k": 5})
    assert req.options(DreamSampler.options) | {} == {"top_p": 0.9, "top_k": 5}
    assert req.ignored(DreamSampler.options, "Dream") == {}


def test_roles_and_content_parts(client):
    def ids(messages, **kw):
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "steps": 8,
                                                      "return_token_ids": True, **kw})
        assert r.status_code == 200, r.text
        return r.json()["mosaic"]["prompt_token_ids"]
    user = {"role": "user", "content": "4321="}
    assert ids([{"role": "developer", "content": "sort "}, user]) == ids([{"role": "system", "content": "sort "},
                                                                          user])
    assert ids([{"role": "user", "content": [{"type": "text", "text": "sort 4321="}]}]) == \
        ids([{"role": "user", "content": "sort 4321="}])
    # an assistant turn with content null (no tool calls), and tool_calls: [] / null sent back
    ids([user, {"role": "assistant", "content": None, "tool_calls": []}, user])
    ids([user, {"role": "assistant", "tool_calls": None, "refusal": None}, user])
    # a tool-calling history is read (serve/structured.history: tests/serve/test_tool_history.py and
    # test_structured_server.py, whose byte-level model spells its default rendering); one answering no call
    r = client.post("/v1/chat/completions", json={"messages": [user, {"role": "tool", "content": "42",
                                                                      "tool_call_id": "c1"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.tool_call_id", r.text
    for messages, param in (
            ([user, {"role": "function", "content": "42", "name": "f"}], "messages.1.role"),
            ([{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}],
             "messages.0.function_call"),
            ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
             "messages.0.content.0")):
        r = client.post("/v1/chat/completions", json={"messages": messages})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param, err
        assert ("legacy function calling" in err["message"]) == (param != "messages.0.content.0"), err
        image = param == "messages.0.content.0"   # its own code: an image is not tool calling
        assert err["code"] == ("content_type_unsupported" if image else "tools_unsupported"), err
        assert ("'image_url' are not supported: this model reads text only" in err["message"]) == image, err
    r = client.post("/v1/chat/completions", json=CHAT | {"tools": [], "tool_choice": "required"})
    assert r.status_code == 400 and "tool calling" in r.json()["error"]["message"]


def test_ids_fingerprint_and_created(client):
    a, b = (client.post("/v1/completions", json=SORT).json() for _ in range(2))
    c = client.post("/v1/chat/completions", json=CHAT).json()
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", a["id"]) and a["id"] != b["id"]
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", c["id"])
    assert re.fullmatch(r"mosaic-\d+\.\d+\.\d+-[0-9a-f]{8}", a["system_fingerprint"])
    assert a["system_fingerprint"] == c["system_fingerprint"]
    assert abs(a["created"] - time.time()) < 120            # seconds, not milliseconds
    with client.stream("POST", "/v1/chat/completions", json=CHAT | {"stream": True}) as r:
        evs = events(r)[:-1]
    assert len({e["id"] for e in evs}) == 1 and evs[0]["id"].startswith("chatcmpl-")
    assert all(e["system_fingerprint"] == a["system_fingerprint"] for e in evs)


def test_full_queue_is_503_with_retry_after():
    # max_batch=1: with continuous batching the second job would join the running batch at the next
    # step boundary and leave the queue empty again, so the third would be admitted (a CI flake)
    with ServerThread(budgeted_engine(), max_model_len=PAST_TRAINED, max_queue=1, max_batch=1, timeout=60) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        worker = srv.app.state.server.worker
        threads = [threading.Thread(target=lambda: c.post("/v1/completions", json=LONG)) for _ in range(2)]
        threads[0].start()
        t0 = time.perf_counter()
        while worker.running is None and time.perf_counter() - t0 < 20:
            time.sleep(0.02)
        threads[1].start()
        while worker.length < 2 and time.perf_counter() - t0 < 20:
            time.sleep(0.02)
        assert worker.running is not None and worker.length == 2     # one runs, one waits
        r = c.post("/v1/completions", json=SORT)
        for t in threads:
            t.join(60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    assert int(r.headers["retry-after"]) >= 1


def test_models_by_id_and_max_model_len(client, server):
    card = client.get("/v1/models").json()["data"][0]
    assert client.get(f"/v1/models/{card['id']}").json() == card
    assert card["capacity_tokens"] == server.app.state.server.capacity_tokens and card["trained_length"] == 64
    assert card["max_model_len"] == PAST_TRAINED
    r = client.get("/v1/models/gpt-4")
    assert r.status_code == 404 and set(r.json()) == {"error"} and r.json()["error"]["code"] == "model_not_found"


def test_max_model_len_without_a_budget_is_the_trained_length():
    from fastapi.testclient import TestClient

    from mosaic.serve.app import create_app
    engine = MosaicEngine(budgeted_engine().model, {"device": "cpu", "progress": False})
    with TestClient(create_app(engine)) as c:
        assert c.get("/health").json()["capacity_tokens"] is None
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 64   # config.json's max_sequence_length


def test_max_completion_tokens_wins_over_max_tokens(client):
    body = client.post("/v1/chat/completions", json=CHAT | {"max_tokens": 4, "max_completion_tokens": 8}).json()
    assert body["mosaic"]["canvas_tokens"] == 8
    req = ChatRequest.model_validate(CHAT | {"max_tokens": 4, "max_completion_tokens": 8})
    assert req.canvas() == (8, "max_completion_tokens")


def test_every_end_of_text_id_ends_the_answer():
    """config.json's eos_token_id may be a list: [20, 18] makes 18 (what tiny-llada writes after
    its answer) an extra id. Only the first was honoured: finish_reason 'length', 8 tokens."""
    from fastapi.testclient import TestClient

    from mosaic.serve.app import create_app
    model = budgeted_engine().model
    listed = dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, eos_id=20, extra_eos_ids=(18,)))
    with TestClient(create_app(MosaicEngine(listed, {"device": "cpu", "progress": False}))) as c:
        body = c.post("/v1/chat/completions", json=CHAT).json()
        assert body["choices"][0]["message"]["content"] == "1234"
        assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 4
        body = c.post("/v1/chat/completions", json=CHAT | {"stop": "34"}).json()
        assert body["choices"][0]["message"]["content"] == "12" and body["usage"]["completion_tokens"] == 2


def test_streams_send_text_only_when_it_is_committed(client):
    req = CHAT | {"stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=req) as r:
        evs = events(r)
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    steps = evs[1:-3]
    assert steps and all(e["choices"][0]["delta"]["content"] for e in steps)   # no empty chunk
    assert [e["mosaic"]["step"] for e in steps] == sorted({e["mosaic"]["step"] for e in steps})
    assert "".join(e["choices"][0]["delta"]["content"] for e in steps) == "1234"
    assert evs[-3]["choices"][0]["finish_reason"] == "stop" and evs[-2]["usage"]["completion_tokens"] == 4
    # with a canvas preview every step is sent: the canvas is what the client asked for
    with client.stream("POST", "/v1/completions", json=SORT | {"stream": True, "stream_canvas": True}) as r:
        assert len(events(r)) == 8 + 2


def test_lossy_labels_and_stats_come_from_the_generation():
    """A block-sparse engine through the server reports generate()'s labels (it reported [])."""
    from fastapi.testclient import TestClient

    from mosaic.serve.app import create_app
    sparse = {"block": 16, "dense_steps": 1, "ranges": [{"layers": [0, 5], "pattern": "window", "window": 1}]}
    engine = MosaicEngine(budgeted_engine().model, {"device": "cpu", "progress": False, "sparse": sparse})
    want = engine.generate("sort 31415926=", max_new_tokens=8, steps=8)
    assert want.lossy
    with TestClient(create_app(engine)) as c:
        full = c.post("/v1/completions", json=SORT).json()["mosaic"]
        early = c.post("/v1/chat/completions", json=CHAT | {"block_length": 1}).json()["mosaic"]
    assert full["lossy"] == want.lossy and full["stats"] == want.stats and not full["stopped_early"]
    assert early["stopped_early"] and early["lossy"] == want.lossy    # stopped early: the same labels


def test_every_declared_generation_option_is_a_request_field():
    """The server's sampler fields derive from GenerationConfig's declarations (config/generation.py):
    Fast-dLLM's cache / threshold / factor reach the engine (a GPU load test had them ignored)."""
    from mosaic.config import OPTIONS
    from mosaic.serve.protocol import OPENAI_NAMED, CompletionRequest
    fields = set(CompletionRequest.model_fields)
    assert {n for n in OPTIONS if n not in OPENAI_NAMED} <= fields
    r = CompletionRequest.model_validate({"prompt": "x", "cache": "dual", "threshold": 0.9, "block_length": 4})
    assert r.options(frozenset({"cache", "threshold", "block_length"})) == {"cache": "dual", "threshold": 0.9,
                                                                            "block_length": 4}
