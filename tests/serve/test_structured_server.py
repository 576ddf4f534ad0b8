"""Structured output through `mosaic serve` on 127.0.0.1 (docs/STRUCTURED.md): the openai SDK's
`chat.completions.parse(response_format=PydanticModel)`, forced tool calls (plain and streamed),
vLLM's guided_* / structured_outputs fields, and the 400s before any work. The model is a random
byte-level LLaDA checkpoint (it can spell JSON; random weights try hardest to break the format)."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from bench.lib.byte_models import byte_checkpoint
from mosaic import MosaicEngine
from mosaic.serve.server import ServerThread

openai = pytest.importorskip("openai")
pytest.importorskip("outlines_core")
FAST = {"steps": 24, "block_length": 32, "cache": "dual", "threshold": 0.9}


class City(BaseModel):
    name: str
    population: int
    coastal: bool


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = byte_checkpoint("llada", tmp_path_factory.mktemp("byte") / "llada", 0)
    engine = MosaicEngine(str(folder), {"device": "cpu", "progress": False})
    with ServerThread(engine, timeout=120) as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def parse(client):
    sdk = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    return sdk


def test_openai_sdk_parse_with_a_pydantic_model(client):
    done = parse(client)(model="llada", messages=[{"role": "user", "content": "a city?"}],
                         response_format=City, max_tokens=96, extra_body=FAST)
    msg = done.choices[0].message
    assert isinstance(msg.parsed, City) and City.model_validate_json(msg.content) == msg.parsed
    assert any(label.startswith("structured:") for label in done.model_extra["mosaic"]["lossy"])
    assert "response_format" not in done.model_extra["mosaic"]["ignored"]


def test_forced_tool_calls(client):
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    done = client.chat.completions.create(model="llada", messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                          max_tokens=96, extra_body=FAST)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
    assert set(args) == ({"city", "unit"} if call.function.name == "get_weather" else {"zone"})
    named = client.chat.completions.create(model="llada", messages=msgs, tools=[WEATHER, TIME], max_tokens=64,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           extra_body=FAST)
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"
    stream = client.chat.completions.create(model="llada", messages=msgs, tools=[WEATHER], tool_choice="required",
                                            max_tokens=96, extra_body=FAST, stream=True)
    chunks = list(stream)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert set(json.loads(calls[0].function.arguments)) == {"city", "unit"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_vllm_fields_and_auto(server):
    import httpx
    url = server.url + "/v1/chat/completions"
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "steps": 16}
    with httpx.Client(timeout=120) as h:
        r = h.post(url, json=base | {"guided_regex": "[a-z]{3}-[0-9]{2}"}).json()
        import re
        assert re.fullmatch("[a-z]{3}-[0-9]{2}", r["choices"][0]["message"]["content"]), r
        r = h.post(url, json=base | {"guided_choice": ["left", "right"]}).json()
        assert r["choices"][0]["message"]["content"] in ("left", "right")
        r = h.post(url, json=base | {"structured_outputs": {"choice": ["up", "down"]}}).json()
        assert r["choices"][0]["message"]["content"] in ("up", "down")
        r = h.post(url, json=base | {"max_tokens": 48, "steps": 24, "guided_json": {"type": "object", "properties": {
            "a": {"type": "integer"}}, "required": ["a"]}}).json()
        assert isinstance(json.loads(r["choices"][0]["message"]["content"])["a"], int)
        r = h.post(url, json=base | {"tools": [WEATHER], "tool_choice": "auto"}).json()
        assert "tool_choice" in r["mosaic"]["ignored"] and r["choices"][0]["message"]["content"] is not None
        done = h.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 8, "steps": 8,
                                                             "response_format": {"type": "json_object"}})
        assert done.status_code == 200 and json.loads(done.json()["choices"][0]["text"]) == {}   # {} fits 8
        schema = {"type": "object", "properties": {"abcdefgh": {"type": "string"}}, "required": ["abcdefgh"]}
        done = h.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 8, "steps": 8,
                                                             "guided_json": schema})
        assert done.status_code == 400 and "15 tokens, more than max_tokens 8" in done.json()["error"]["message"]


@pytest.mark.parametrize("body,words", [
    ({"guided_regex": "(a"}, "cannot be compiled"),
    ({"guided_grammar": "root ::= 'a'"}, "context-free grammars are not supported"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "one output constraint"),
    ({"response_format": {"type": "xml"}}, "'text', 'json_object', 'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "cannot be compiled"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "get_weather"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "drop response_format"),
])
def test_bad_constraints_are_400s(server, body, words):
    import httpx
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16} | body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_tool_result_sent_back_then_a_text_answer(client):
    """The agent loop's round trip through the openai SDK: a forced call, then the history with the
    tool's result (assistant tool_calls + a tool message, as the SDK and LangChain send them back)
    answered in text."""
    msgs = [{"role": "user", "content": "weather in Oslo?"}]
    first = client.chat.completions.create(model="llada", messages=msgs, tools=[WEATHER], tool_choice="required",
                                           max_tokens=96, extra_body=FAST)
    call = first.choices[0].message.tool_calls[0]
    msgs += [first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "-3 c, snow"}]
    assert msgs[1]["tool_calls"][0]["id"] == call.id and "content" not in msgs[1]
    done = client.chat.completions.create(model="llada", messages=msgs, tools=[WEATHER], max_tokens=32,
                                          extra_body=FAST | {"return_token_ids": True})
    choice = done.choices[0]
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
    assert not choice.message.tool_calls and "tool_choice" in done.model_extra["mosaic"]["ignored"]
    # the history reached the prompt: the call and the result in the default rendering
    prompt = bytes(i for i in done.model_extra["mosaic"]["prompt_token_ids"] if i < 256).decode()   # id = byte
    assert '{"name": "get_weather", "arguments": {' in prompt and "The function get_weather returned: -3 c, snow" \
        in prompt
