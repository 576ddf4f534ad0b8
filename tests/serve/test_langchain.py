"""LangChain's ChatOpenAI against `mosaic serve` on 127.0.0.1, unchanged: with_structured_output
(json_schema and function calling methods) and bind_tools(..., tool_choice="required"). Optional:
skipped without langchain-openai (not in the dev extra: ~20 MB of dependencies, docs/STRUCTURED.md)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from bench.lib.byte_models import byte_checkpoint
from mosaic import MosaicEngine
from mosaic.serve.server import ServerThread

pytest.importorskip("outlines_core")
lc = pytest.importorskip("langchain_openai")
FAST = {"steps": 24, "block_length": 32, "cache": "dual", "threshold": 0.9}


class Answer(BaseModel):
    """An answer with a confidence."""
    text: str = Field(max_length=10)
    confidence: float


def weather(city: str, unit: str) -> str:
    """The weather in a city (unit: c or f)."""
    return f"{city} {unit}"


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    folder = byte_checkpoint("llada", tmp_path_factory.mktemp("byte") / "llada", 0)
    engine = MosaicEngine(str(folder), {"device": "cpu", "progress": False})
    with ServerThread(engine, timeout=120) as srv:
        yield lc.ChatOpenAI(base_url=srv.url + "/v1", api_key="x", model="llada", max_tokens=96, max_retries=0,
                            timeout=120, extra_body=FAST)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(chat, method):
    got = chat.with_structured_output(Answer, method=method).invoke("answer briefly")
    assert isinstance(got, Answer)


def test_bind_tools_required(chat):
    msg = chat.bind_tools([weather], tool_choice="required").invoke("weather in Oslo?")
    call = msg.tool_calls[0]
    assert call["name"] == "weather" and set(call["args"]) == {"city", "unit"}


def test_agent_loop_sends_the_tool_result_back(chat):
    """LangChain's agent loop: the forced call, the tool run, its ToolMessage sent back with the
    AIMessage that made the call, then a text answer (tool_choice unset: text)."""
    from langchain_core.messages import HumanMessage, ToolMessage
    history = [HumanMessage("weather in Oslo?")]
    ai = chat.bind_tools([weather], tool_choice="required").invoke(history)
    call = ai.tool_calls[0]
    history += [ai, ToolMessage(weather(**call["args"]), tool_call_id=call["id"])]
    answer = chat.bind_tools([weather]).invoke(history)
    assert isinstance(answer.content, str) and not answer.tool_calls
