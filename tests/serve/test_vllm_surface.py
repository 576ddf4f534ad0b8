"""What clients written for vLLM expect besides the OpenAI routes: /tokenize, /detokenize,
/version, /ping; CORS for browser clients (--allowed-origins, off by default); /metrics readable
without the API key (an option protects it); `model: ""` as the served model; `seed: -1`
(random, reported); `stop_reason` in the choices; vLLM's extras implemented (stop_token_ids,
include_stop_str_in_output) or refused with a 400 naming them (min_tokens, repetition_penalty),
never listed in mosaic.ignored; stream_options without stream a 400."""

import pytest
from fastapi.testclient import TestClient
from serving import budgeted_engine, events

from mosaic import __version__
from mosaic.serve.app import create_app

SORT = {"prompt": "sort 31415926=", "max_tokens": 8, "steps": 8}      # -> 11234569
KEY = {"Authorization": "Bearer k3y"}


@pytest.fixture(scope="module")
def engine():
    return budgeted_engine()


@pytest.fixture(scope="module")
def c(engine):
    with TestClient(create_app(engine, api_key="k3y")) as client:
        yield client


def test_version_ping_and_metrics_need_no_key(c):
    assert c.get("/version").json() == {"version": __version__}
    assert c.get("/ping").status_code == 200 and c.post("/ping").status_code == 200
    assert c.get("/metrics").status_code == 200 and c.get("/health").status_code == 200
    assert c.get("/v1/models").status_code == 401 and c.post("/tokenize", json={"prompt": "1"}).status_code == 401


def test_metrics_can_be_protected(engine):
    with TestClient(create_app(engine, api_key="k3y", protect_metrics=True)) as p:
        assert p.get("/metrics").status_code == 401 and p.get("/metrics", headers=KEY).status_code == 200


def test_tokenize_and_detokenize(c, engine):
    r = c.post("/tokenize", json={"prompt": "sort 321=", "model": ""}, headers=KEY).json()
    assert r["tokens"] == engine.encode("sort 321=")[0] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 64 and r["token_strs"] is None
    bare = c.post("/tokenize", json={"prompt": "sort 321=", "add_special_tokens": False,
                                     "return_token_strs": True}, headers=KEY).json()
    assert bare["tokens"] == r["tokens"][1:] and "".join(bare["token_strs"]) == "sort 321="
    chat = c.post("/tokenize", json={"messages": [{"role": "user", "content": "sort 321="}]}, headers=KEY).json()
    assert chat["tokens"] == engine.encode([{"role": "user", "content": "sort 321="}], chat=True)[0]
    assert c.post("/detokenize", json={"tokens": bare["tokens"]}, headers=KEY).json() == {"prompt": "sort 321="}
    for path, body, field in (("/tokenize", {"prompt": "sort ä"}, "prompt"),
                              ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
                              ("/tokenize", {"prompt": 3}, "prompt")):
        bad = c.post(path, json=body, headers=KEY)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, bad.text
    assert c.post("/tokenize", json={"prompt": "1", "model": "gpt-4"}, headers=KEY).status_code == 404


def test_cors_only_for_the_origins_given(engine, c):
    pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    assert "access-control-allow-origin" not in c.options("/v1/completions", headers=pre).headers
    with TestClient(create_app(engine, api_key="k3y", allowed_origins=("https://app.example",))) as w:
        r = w.options("/v1/completions", headers=pre)       # the preflight carries no key
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        ok = w.post("/v1/completions", json=SORT, headers=KEY | {"Origin": "https://app.example"})
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        assert "access-control-allow-origin" not in w.options("/v1/completions", headers=pre | {
            "Origin": "https://evil.example"}).headers


def test_empty_model_and_seeds(c):
    a = c.post("/v1/completions", json=SORT | {"model": "", "seed": -1, "temperature": 1}, headers=KEY).json()
    assert 0 <= a["mosaic"]["seed"] < 2**64
    b = c.post("/v1/completions", json=SORT | {"seed": -2, "temperature": 1}, headers=KEY).json()
    assert b["mosaic"]["seed"] == 2**64 - 2
    r = c.post("/v1/completions", json=SORT | {"seed": 2**64}, headers=KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


def test_stop_reason_stop_ids_and_kept_stop_strings(c, engine):
    plain = c.post("/v1/completions", json=SORT, headers=KEY).json()["choices"][0]
    assert plain["text"] == "11234569" and plain["finish_reason"] == "length" and plain["stop_reason"] is None
    cut = c.post("/v1/completions", json=SORT | {"stop": ["23"]}, headers=KEY).json()
    assert cut["choices"][0]["text"] == "11" and cut["choices"][0]["stop_reason"] == "23"
    kept = c.post("/v1/completions", json=SORT | {"stop": "23", "include_stop_str_in_output": True}, headers=KEY)
    assert kept.json()["choices"][0]["text"] == "1123" and kept.json()["mosaic"]["ignored"] == {}
    four = engine.encode("4")[0][-1]
    ids = c.post("/v1/completions", json=SORT | {"stop_token_ids": [four]}, headers=KEY).json()["choices"][0]
    assert ids["text"] == "11234" and ids["stop_reason"] == four and ids["finish_reason"] == "stop"
    with c.stream("POST", "/v1/completions", json=SORT | {"stop": "23", "include_stop_str_in_output": True,
                                                          "stream": True}, headers=KEY) as s:
        got = events(s)[:-1]
    assert "".join(e["choices"][0]["text"] for e in got) == "1123" and got[-1]["choices"][0]["stop_reason"] == "23"


@pytest.mark.parametrize("field, value", [("min_tokens", 4), ("repetition_penalty", 1.3),
                                          ("stream_options", {"include_usage": True})])
def test_extras_without_effect_are_refused_by_name(c, field, value):
    r = c.post("/v1/completions", json=SORT | {field: value}, headers=KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_neutral_extras_are_accepted_and_not_listed_as_ignored(c):
    body = SORT | {"min_tokens": 0, "repetition_penalty": 1.0, "stop_token_ids": [],
                   "include_stop_str_in_output": False}
    r = c.post("/v1/completions", json=body, headers=KEY).json()
    assert r["choices"][0]["text"] == "11234569" and r["mosaic"]["ignored"] == {}
