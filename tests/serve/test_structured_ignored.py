"""The server names the JSON Schema keywords its grammar does not enforce in `mosaic.ignored`
(config/structured.UNENFORCED: numeric bounds, multipleOf, ...), at their request field paths,
for response_format, guided_json / structured_outputs and a forced tool call's parameters."""

from __future__ import annotations

import pytest
from conftest import bundled

from mosaic import MosaicEngine
from mosaic.serve.protocol import ChatRequest
from mosaic.serve.state import Server

pytest.importorskip("outlines_core")
pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from mosaic.serve.app import create_app  # noqa: E402

S = {"prompt": "57+384=", "max_tokens": 8}


@pytest.fixture(scope="module")
def client():
    engine = MosaicEngine(str(bundled("tiny-llada")), {"device": "cpu", "progress": False})
    with TestClient(create_app(engine)) as c:
        yield c


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}


@pytest.mark.parametrize("body, path", [
    ({"response_format": schema_format({"type": "number", "minimum": 1000})},
     "response_format.json_schema.schema.minimum"),
    ({"guided_json": {"type": "integer", "multipleOf": 7}}, "guided_json.multipleOf"),
    ({"structured_outputs": {"json": {"type": "number", "exclusiveMaximum": 5}}}, "structured_outputs.json."
     "exclusiveMaximum"),
])
def test_an_unenforced_bound_is_listed(client, body, path):
    r = client.post("/v1/completions", json=S | body)
    assert r.status_code == 200, r.text
    mosaic = r.json()["mosaic"]
    assert list(mosaic["ignored"]) == [path] and "not enforced" in mosaic["ignored"][path]
    assert any("not enforced" in label and path.rsplit(".", 1)[1] in label for label in mosaic["lossy"])


def test_an_enforced_schema_lists_nothing(client):
    r = client.post("/v1/completions", json=S | {"response_format": schema_format({"type": "integer"})})
    assert r.status_code == 200 and r.json()["mosaic"]["ignored"] == {}, r.text


def test_integer_bounds_hold(client):
    """tiny-llada answers 441 free; an integer's minimum is enforced (config/int_range.py)."""
    r = client.post("/v1/completions", json=S | {"response_format": schema_format({"type": "integer",
                                                                                   "minimum": 1000})})
    assert r.status_code == 200 and r.json()["mosaic"]["ignored"] == {}, r.text
    assert int(r.json()["choices"][0]["text"]) >= 1000


def test_bounds_no_integer_fits_are_a_400(client):
    r = client.post("/v1/completions", json=S | {"guided_json": {"type": "integer", "minimum": 5, "maximum": 3}})
    assert r.status_code == 400 and "no integer fits the bounds" in r.json()["error"]["message"], r.text


def test_a_forced_tool_calls_parameters_are_named_by_tool():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "number", "minimum": 3}}}}}
    other = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"m": {"type": "integer", "maximum": 3}}}}}
    req = ChatRequest(messages=[{"role": "user", "content": "x"}], tools=[other, tool],
                      tool_choice={"type": "function", "function": {"name": "f"}})
    ignored = {}
    Server.constraint(req, True, ignored)
    assert list(ignored) == ["tools.1.function.parameters.properties.n.minimum"]
