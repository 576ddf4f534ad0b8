"""The official `openai` Python SDK against the server on 127.0.0.1 with the bundled tiny-llada:
sync and async clients, streaming with usage, Mosaic's fields through extra_body, and the SDK's
own error classes for a context overflow, a wrong API key and an unknown model."""

import asyncio

import pytest
from serving import PAST_TRAINED, budgeted_engine

from mosaic.serve.server import ServerThread

openai = pytest.importorskip("openai")
KEY = "sdk-key"
CHAT = [{"role": "user", "content": "sort 4321="}]


@pytest.fixture(scope="module")
def server():
    with ServerThread(budgeted_engine(), max_model_len=PAST_TRAINED, api_key=KEY, timeout=60) as srv:
        yield srv


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def test_sync_completion_and_chat(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-llada"]
    assert client.models.retrieve("tiny-llada").id == "tiny-llada"
    done = client.completions.create(model="tiny-llada", prompt="sort 31415926=", max_tokens=8, extra_body={"steps": 8})
    assert done.choices[0].text == "11234569" and done.usage.completion_tokens == 8
    chat = client.chat.completions.create(model="tiny-llada", messages=CHAT, max_completion_tokens=8, top_p=0.9,
                                          extra_body={"steps": 8})
    assert chat.choices[0].message.content == "1234" and chat.choices[0].finish_reason == "stop"
    assert chat.id.startswith("chatcmpl-") and chat.system_fingerprint.startswith("mosaic-")
    assert "top_p" in chat.model_extra["mosaic"]["ignored"]


def test_sync_streaming_with_usage(client):
    stream = client.chat.completions.create(model="tiny-llada", messages=CHAT, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "1234"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_async_client(server):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
            answers = await asyncio.gather(*(c.chat.completions.create(model="tiny-llada", messages=CHAT,
                                                                       max_tokens=8) for _ in range(3)))
            stream = await c.completions.create(model="tiny-llada", prompt="sort 907=", max_tokens=8, stream=True)
            text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
        return [a.choices[0].message.content for a in answers], text
    answers, text = asyncio.run(run())
    assert answers == ["1234"] * 3 and text == "079"


def test_the_sdks_error_classes(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-llada", messages=CHAT, max_tokens=100_000)
    assert e.value.code == "context_length_exceeded" and "maximum context length" in e.value.message
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad, \
            pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
