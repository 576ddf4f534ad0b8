"""A tool-calling history in a chat request (serve/structured.history): rendered through a chat
template that renders tool_calls (as transformers passes them: arguments as objects, the tool
message named), else the documented default (the calls as JSON lines of the assistant's turn, each
result a user message); the errors of a malformed history."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from bench.lib.byte_models import byte_tokenizer_json
from mosaic.errors import InputError
from mosaic.serve.protocol import ChatRequest
from mosaic.serve.structured import history
from mosaic.tokenizer import TextTokenizer

# the shape of Qwen2.5's template (tool calls in <tool_call> tags, results in <tool_response>)
TOOL_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'tool' %}<|bos|>user\n<tool_response>\n{{ m.content }}\n</tool_response>\n"
    "{% elif m.tool_calls %}<|bos|>assistant\n{{ m.content }}{% for c in m.tool_calls %}<tool_call>\n"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}\n{% else %}<|bos|>{{ m.role }}\n{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": "{\"city\": \"Oslo\", \"unit\": \"c\"}"}}
BODY = {"messages": [{"role": "user", "content": "weather in Oslo?"},
                     {"role": "assistant", "content": None, "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "-3 and snow"}]}


def test_a_template_that_renders_tool_calls_gets_them_as_transformers_passes_them():
    msgs = history(ChatRequest.model_validate(BODY).chat(), TOOL_TEMPLATE)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo", "unit": "c"}
    assert msgs[2] == {"role": "tool", "content": "-3 and snow", "tool_call_id": "call_1", "name": "get_weather"}
    tok = TextTokenizer(Tokenizer.from_str(byte_tokenizer_json()), {}, chat_template=TOOL_TEMPLATE)
    text = tok.apply_chat_template(msgs)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>' in text
    assert "<tool_response>\n-3 and snow\n</tool_response>" in text and text.endswith("<|bos|>assistant\n")


def test_the_default_says_the_calls_and_their_results_in_plain_turns():
    msgs = history(ChatRequest.model_validate(BODY).chat(), "{{ messages }}")
    assert msgs[1] == {"role": "assistant", "content": json.dumps({"name": "get_weather",
                                                                  "arguments": {"city": "Oslo", "unit": "c"}})}
    assert msgs[2] == {"role": "user", "content": "The function get_weather returned: -3 and snow"}
    plain = [{"role": "user", "content": "hi"}]
    assert history(plain, None) is plain


@pytest.mark.parametrize("change,words", [
    (lambda b: b["messages"][2].update(tool_call_id="call_9"), "no earlier assistant message's tool_calls"),
    (lambda b: b["messages"][1]["tool_calls"][0]["function"].update(arguments="[1]"), "must be a JSON object"),
    (lambda b: b["messages"][1]["tool_calls"][0]["function"].update(arguments="{"), "is not JSON"),
])
def test_a_malformed_history_is_one_error_naming_it(change, words):
    body = json.loads(json.dumps(BODY))
    change(body)
    with pytest.raises(InputError, match=words):
        history(ChatRequest.model_validate(body).chat(), None)
