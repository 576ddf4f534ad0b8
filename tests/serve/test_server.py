"""The OpenAI-compatible server on 127.0.0.1 with the bundled tiny-llada: every endpoint,
streaming, admission refusals, malformed requests, cancellation."""

import threading
import time

import pytest
from serving import PAST_TRAINED, budgeted_engine, events, httpx

from mosaic.serve.server import ServerThread

SORT = {"prompt": "sort 31415926=", "max_tokens": 8, "steps": 8}
LONG = {"prompt": "sort 31415926=", "max_tokens": 96, "steps": 96}   # ~1-3 s on the CPU


@pytest.fixture(scope="module")
def server():
    """In-process uvicorn on 127.0.0.1 (a free port), stopped and joined at the module's end."""
    with ServerThread(budgeted_engine(), max_model_len=PAST_TRAINED, timeout=60) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def wait_for(pred, timeout=20.0):
    t0 = time.perf_counter()
    while not pred():
        assert time.perf_counter() - t0 < timeout, "timed out"
        time.sleep(0.02)


def test_health_models_metrics(client, server):
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["model"] == "tiny-llada" and h["queue_length"] == 0
    cap = h["capacity_tokens"]
    assert 100 < cap < 2000
    m = client.get("/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "tiny-llada" and m["data"][0]["capacity_tokens"] == cap
    assert h["max_model_len"] == m["data"][0]["max_model_len"] == PAST_TRAINED and h["trained_length"] == 64
    text = client.get("/metrics").text
    for name in ("mosaic_queue_length", 'mosaic_device_memory_bytes{part="weights"}',
                 'mosaic_device_memory_bytes{part="budget"}', "mosaic_tokens_per_second",
                 "mosaic_refusals_total", "mosaic_requests_total"):
        assert name in text, name


def test_completion_is_the_engines_answer(client, server):
    r = client.post("/v1/completions", json=SORT)
    assert r.status_code == 200
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and choice["text"] == "11234569"
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 15, "completion_tokens": 8, "total_tokens": 23}
    mos = body["mosaic"]
    assert mos["path"] == "planned" and mos["steps"] == mos["steps_run"] == 8 and mos["canvas_tokens"] == 8
    assert mos["predicted_bytes"] <= server.app.state.server.engine.budget.budget_bytes


def test_chat_completion(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "sort 4321="}],
                                                   "max_tokens": 8, "steps": 8, "model": "tiny-llada"})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "1234"}
    assert body["choices"][0]["finish_reason"] == "stop"      # end-of-text after 4 of 8 canvas tokens
    assert body["usage"]["completion_tokens"] == 4


def test_seed_reproduces_a_sampled_answer(client):
    req = SORT | {"temperature": 1.5, "seed": 7}
    a, b = client.post("/v1/completions", json=req).json(), client.post("/v1/completions", json=req).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["mosaic"]["seed"] == 7
    c = client.post("/v1/completions", json=SORT | {"temperature": 1.5}).json()
    assert isinstance(c["mosaic"]["seed"], int)     # every request reports the seed it ran with


def test_stop_strings_trim_the_answer(client):
    body = client.post("/v1/completions", json=SORT | {"stop": ["45", "x"]}).json()
    assert body["choices"][0]["text"] == "1123" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 4
    with client.stream("POST", "/v1/completions", json=SORT | {"stop": "45", "stream": True}) as r:
        evs = events(r)
    assert "".join(e["choices"][0]["text"] for e in evs[:-1]) == "1123"


def test_streaming_sends_committed_text_after_every_step(client):
    req = SORT | {"block_length": 1, "stream": True, "stream_canvas": True}   # left to right: a token a step
    arrived = []
    with client.stream("POST", "/v1/completions", json=req) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrived.append(time.perf_counter())
        # re-read is impossible: parse what was recorded by a second request below
    with client.stream("POST", "/v1/completions", json=req) as r:
        evs = events(r)
    steps = [e for e in evs[:-2]]
    assert [e["mosaic"]["step"] for e in steps] == list(range(1, 9))
    assert steps[0]["choices"][0]["text"] == "1"           # the first token, right after step 1
    assert steps[0]["mosaic"]["canvas"] == "1_______"
    assert all(e["choices"][0]["finish_reason"] is None for e in steps)
    final = evs[-2]
    assert final["choices"][0]["finish_reason"] == "length" and final["mosaic"]["steps_run"] == 8
    assert evs[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in evs[:-1]) == "11234569"
    assert arrived[0] < arrived[-1]                        # events arrive as steps go, not all at the end


def test_streaming_default_sampler_matches_the_plain_answer(client):
    with client.stream("POST", "/v1/completions", json=SORT | {"stream": True}) as r:
        evs = events(r)
    # text as it is committed: no chunk for a step that commits nothing (was one per step)
    assert len(evs) <= 8 + 2 and all(e["choices"][0]["text"] for e in evs[:-2])
    assert "".join(e["choices"][0]["text"] for e in evs[:-1]) == "11234569"


def test_chat_streaming_with_usage(client):
    req = {"messages": [{"role": "user", "content": "sort 4321="}], "max_tokens": 8, "steps": 8, "stream": True,
           "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=req) as r:
        evs = events(r)
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert evs[0]["object"] == "chat.completion.chunk"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in evs[1:-2])
    assert text == "1234"
    assert evs[-3]["choices"][0]["finish_reason"] == "stop"
    assert evs[-2]["choices"] == [] and evs[-2]["usage"]["completion_tokens"] == 4
    assert evs[-1] == "[DONE]"


def test_oversized_request_is_refused_with_what_fits(client):
    r = client.post("/v1/completions", json={"prompt": "sort 31415926=", "max_tokens": 1024})
    assert r.status_code == 400      # OpenAI's and vLLM's context overflow (was 413)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "context_length_exceeded"
    assert err["reason"] == "memory_budget"
    assert err["needed_bytes"] > err["available_bytes"] > 0
    assert 0 < err["max_tokens"] < 1039 and err["max_new_tokens"] == err["max_tokens"] - 15
    assert "longest that fits" in err["message"]
    # what it names does fit
    ok = client.post("/v1/completions", json={"prompt": "sort 31415926=", "max_tokens": err["max_new_tokens"],
                                              "steps": 1})
    assert ok.status_code == 200, ok.text
    r = client.post("/v1/completions", json={"prompt": [3] * 2000, "max_tokens": 8})
    assert r.status_code == 400 and r.json()["error"]["prompt_tokens"] == 2000


def test_the_advertised_capacity_is_admitted_and_one_more_token_is_not(client):
    cap = client.get("/health").json()["capacity_tokens"]
    assert client.get("/v1/models").json()["data"][0]["capacity_tokens"] == cap
    # the shape it is for: a 1-token prompt and max_tokens = capacity - 1, default sampler options
    ok = client.post("/v1/completions", json={"prompt": [3], "max_tokens": cap - 1, "steps": 1})
    assert ok.status_code == 200, ok.text
    r = client.post("/v1/completions", json={"prompt": [3], "max_tokens": cap, "steps": 1})
    assert r.status_code == 400 and r.json()["error"]["requested_tokens"] == cap + 1
    # a longer prompt of the same total masks fewer rows: admitted too
    ok = client.post("/v1/completions", json={"prompt": "sort 31415926=", "max_tokens": cap - 15, "steps": 1})
    assert ok.status_code == 200, ok.text


def test_refusal_is_immediate_while_the_engine_is_busy(client, server):
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("r", client.post("/v1/completions", json=LONG)))
    t.start()
    wait_for(lambda: server.app.state.server.worker.running is not None)
    r = client.post("/v1/completions", json={"prompt": "sort 1=", "max_tokens": 4096})
    still_running = server.app.state.server.worker.running is not None
    t.join(60)
    assert r.status_code == 400 and still_running
    assert done["r"].status_code == 200


def test_max_seq_len_refusal():
    from fastapi.testclient import TestClient

    from mosaic.serve.app import create_app
    with TestClient(create_app(budgeted_engine(max_seq_len=24))) as c:
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 24     # max_seq_len under the trained 64
        r = c.post("/v1/completions", json={"prompt": "sort 31415926=", "max_tokens": 16})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["reason"] == "max_seq_len"
        assert err["max_tokens"] == 24 and err["max_new_tokens"] == 9
        assert c.post("/v1/completions", json=SORT).json()["choices"][0]["text"] == "11234569"


BAD = [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"max_tokens": 8}, 400, "missing field 'prompt'"),
    ({"prompt": 3}, 400, "prompt: expected a string"),
    ({"prompt": "1", "max_tokens": 8.5}, 400, "max_tokens"),   # "8" and 8.0 are 8 (lax, as clients send them)
    ({"prompt": "1", "max_tokens": 0}, 400, "max_tokens must be positive, got 0"),
    ({"prompt": "1", "max_tokens": -1}, 400, "max_tokens must be positive, got -1"),
    ({"prompt": ""}, 400, "prompt is empty"),
    ({"prompt": []}, 400, "prompt is empty"),
    ({"prompt": [""]}, 400, "prompt is empty"),
    ({"prompt": "1", "alg": "entropy"}, 400, "alg is a Dream sampler option"),
    ({"prompt": "1", "max_tokens": 8, "block_length": 3}, 400, "not divisible by block_length 3"),
    ({"prompt": "1", "max_tokens": 8, "remasking": "sideways"}, 400, "remasking 'sideways'"),
    ({"prompt": "1", "n": 2}, 400, "one choice per request"),
    ({"prompt": ["a", "b"]}, 400, "one prompt per request"),
    ({"prompt": "1", "temperature": -1}, 400, "temperature must be >= 0"),
    ({"prompt": "1", "mask_ratio": 1.5}, 400, "mask_ratio"),
    ({"prompt": "1", "stop": [""]}, 400, "non-empty"),
    ({"prompt": "1", "logprobs": 2}, 400, "logprobs"),
    ({"prompt": [500]}, 400, "outside the vocabulary"),
    ({"prompt": "1", "model": "gpt-4"}, 404, "not served here"),
]


@pytest.mark.parametrize("body, status, message", BAD)
def test_malformed_completion_requests_get_a_clear_4xx(client, body, status, message):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = client.post("/v1/completions", **kw)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    assert "max_new_tokens" not in r.json()["error"]["message"]   # the API's words, not the engine's


@pytest.mark.parametrize("extra, param", [
    ({"steps": 0}, "steps"), ({"steps": 5, "block_length": 4}, "steps"), ({"temperature": -1}, "temperature"),
    ({"seed": 2**64}, "seed"), ({"block_length": 0}, "block_length"), ({"block_length": 3}, "max_tokens"),
    ({"speculate": -1}, "speculate"), ({"mask_ratio": 2}, "mask_ratio"), ({"cfg_scale": -1}, "cfg_scale"),
    ({"cache": "x"}, "cache"), ({"threshold": 2}, "threshold"), ({"alg": "entropy"}, "alg"),
    ({"prompt": "sort \u00e9"}, "prompt"), ({"prompt": [500]}, "prompt"),
])
def test_an_engine_checked_field_error_names_the_field(client, extra, param):
    """They used to come back with param null while the server's own checks named the field."""
    r = client.post("/v1/completions", json={"prompt": "sort 1234=", "max_tokens": 8} | extra)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param, err


def test_a_value_from_generation_config_json_is_named_as_such(client):
    """tiny-llada's generation_config.json sets max_new_tokens 8 and steps 8 (fitted to 16 blocks,
    not refused as if the request had set it; a request's own steps 8 is)."""
    assert client.post("/v1/completions", json={"prompt": "sort 12=", "max_tokens": 16, "block_length": 1}).is_success
    err = client.post("/v1/completions", json={"prompt": "sort 12=", "max_tokens": 16, "block_length": 1,
                                               "steps": 8}).json()["error"]
    assert err["message"].startswith("steps 8 must be") and "generation_config.json" not in err["message"]
    err = client.post("/v1/completions", json={"prompt": "sort 12=", "block_length": 3}).json()["error"]
    assert err["message"].startswith("max_tokens 8 (from generation_config.json) is not divisible"), err


def test_an_engine_error_about_the_canvas_names_the_field_the_request_used(client):
    chat = {"messages": [{"role": "user", "content": "sort 12="}], "block_length": 4}
    for field in ("max_tokens", "max_completion_tokens"):
        err = client.post("/v1/chat/completions", json=chat | {field: 6}).json()["error"]
        assert err["param"] == field and "not divisible by block_length 4" in err["message"], err


@pytest.mark.parametrize("body, message, param", [
    ({"messages": []}, "messages: expected", "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]},
     "messages.0.role: invalid role 'wizard'; allowed roles: system, user, assistant", "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "missing field 'messages.0.content'", "messages.0.content"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": 3}]},
     "messages.1.content: expected a string or a list of", "messages.1.content"),
    ({"messages": [{"role": "user", "content": "hi", "mood": "x"}]}, "unknown field 'messages.0.mood'",
     "messages.0.mood"),
    ({"messages": "hi"}, "messages: expected", "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -2},
     "max_completion_tokens must be positive, got -2", "max_completion_tokens"),
])
def test_malformed_chat_requests(client, body, message, param):
    r = client.post("/v1/chat/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and message in err["message"], err
    assert err["param"] == param


def test_wrong_method_and_path(client):
    for r, status, code in ((client.get("/v1/completions"), 405, "method_not_allowed"),
                            (client.get("/v2/nothing"), 404, "not_found")):
        assert r.status_code == status
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == code and body["error"]["message"]
    assert "POST" in client.get("/v1/completions").headers["allow"]


def test_an_absurd_length_without_a_budget_is_a_4xx_not_a_500():
    """No budget: nothing refuses the length at admission but the engine (an InputError for a
    canvas the host cannot hold: 400)."""
    from fastapi.testclient import TestClient

    from mosaic import MosaicEngine
    from mosaic.serve.app import create_app
    engine = budgeted_engine()
    with TestClient(create_app(MosaicEngine(engine.model, {"device": "cpu", "progress": False}))) as c:
        r = c.post("/v1/completions", json={"prompt": "sort 1=", "max_tokens": 100_000_000_000})
        assert 400 <= r.status_code < 500, r.text
        assert r.json()["error"]["type"] != "server_error"


def cancelled(srv):
    return list(srv.app.state.server.cancelled)


def test_streaming_client_that_leaves_cancels_the_request(client, server):
    before = len(cancelled(server))
    with client.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break                    # one step seen; leave
    wait_for(lambda: len(cancelled(server)) > before)
    assert 1 <= cancelled(server)[-1] < 96
    wait_for(lambda: server.app.state.server.worker.running is None)
    # the engine is released cleanly: the next request runs and gives the same answer
    assert client.post("/v1/completions", json=SORT).json()["choices"][0]["text"] == "11234569"


def test_non_streaming_client_that_leaves_cancels_the_request(server, caplog):
    """...and the server's log says so with HTTP 499 (uvicorn logs no line for a response nobody
    receives, so the handler does)."""
    before = len(cancelled(server))
    with caplog.at_level("INFO", logger="mosaic.serve"):
        with httpx.Client(base_url=server.url, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=LONG)
        wait_for(lambda: len(cancelled(server)) > before)
        wait_for(lambda: any('"POST /v1/completions" 499' in r.getMessage() for r in caplog.records))
    assert cancelled(server)[-1] < 96


def test_queued_request_whose_client_left_never_runs(client, server, monkeypatch):
    before = len(cancelled(server))     # one sequence at a time: the second one waits
    monkeypatch.setattr(server.app.state.server.worker.scheduler, "max_seqs", 1)
    (t := threading.Thread(target=lambda: client.post("/v1/completions", json=LONG))).start()
    wait_for(lambda: server.app.state.server.worker.running is not None)
    with client.stream("POST", "/v1/completions", json=SORT | {"stream": True}):
        wait_for(lambda: server.app.state.server.worker.length == 2)
    t.join(60)
    wait_for(lambda: len(cancelled(server)) > before)
    assert cancelled(server)[-1] == 0      # it never ran a step
    m = client.get("/metrics").text
    assert "mosaic_cancelled_total" in m


def test_return_token_ids(client):
    body = client.post("/v1/completions", json=SORT | {"return_token_ids": True}).json()
    mos = body["mosaic"]
    assert len(mos["prompt_token_ids"]) == 15 and len(mos["token_ids"]) == 8
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "sort 4321="}],
                                                      "max_tokens": 8, "steps": 8, "return_token_ids": True}).json()
    assert len(chat["mosaic"]["token_ids"]) == chat["usage"]["completion_tokens"] == 4   # cut at end-of-text


def test_denoising_stops_once_the_committed_prefix_ends_the_answer(client):
    req = {"messages": [{"role": "user", "content": "sort 4321="}], "max_tokens": 8, "steps": 8}
    full = client.post("/v1/chat/completions", json=req).json()
    early = client.post("/v1/chat/completions", json=req | {"block_length": 1}).json()   # left to right
    assert early["choices"][0]["message"]["content"] == full["choices"][0]["message"]["content"] == "1234"
    # "1234" then end-of-text: committed after step 5 of 8; the rest of the canvas cannot matter
    assert early["mosaic"]["stopped_early"] and early["mosaic"]["steps_run"] == 5


def test_a_long_running_server_keeps_only_recent_step_history(client, server, monkeypatch):
    monkeypatch.setattr(server.app.state.server.engine.preparer, "history_keep", 4)
    assert client.post("/v1/completions", json=SORT).status_code == 200     # 8 steps
    wait_for(lambda: server.app.state.server.worker.running is None)
    assert len(server.app.state.server.engine.history) == 4
