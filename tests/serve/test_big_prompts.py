"""A prompt whose size alone proves it too long is refused before it is tokenized (QA: a 14 MB
prompt took 101.7 s to refuse and held /health for 63 s), and a request's body is read and
validated off the event loop."""

import random
import threading
import time

import pytest
from serving import PAST_TRAINED, budgeted_engine, httpx

from mosaic.serve import api_errors
from mosaic.serve.server import ServerThread

BIG = "sort 1=" * 300_000          # 2.1 MB: 2.1M tokens of tiny-llada, ~6 s to tokenize


@pytest.fixture(scope="module")
def server():
    with ServerThread(budgeted_engine(), max_model_len=PAST_TRAINED, timeout=60) as srv:
        yield srv


@pytest.fixture
def never_tokenized(server, monkeypatch):
    tok = server.app.state.server.engine.model.tokenizer
    seen = []
    for name in ("encode", "encode_chat"):
        real = getattr(tok, name)
        monkeypatch.setattr(tok, name, lambda *a, _real=real, **k: seen.append(1) or _real(*a, **k))
    return seen


def test_least_tokens_is_a_lower_bound_of_the_encoding(server):
    tok = server.app.state.server.engine.model.tokenizer
    assert tok.max_token_bytes == 1                      # tiny-llada's plain tokens are characters
    rng = random.Random(0)
    pieces = [t for t in tok.plain_vocab if t.strip()] + [" ", "  ", "<|eos|>", "<|bos|>", "<|mask|>"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))).strip() or "1"
        assert tok.least_tokens(text) <= len(tok.encode(text)), text
    assert tok.least_tokens("sort 31415926=") == 13       # 14 bytes less one space (the BOS is extra)
    assert tok.least_tokens("   \n\t\u3000") == 0          # whitespace may be dropped: counted as nothing
    assert tok.least_tokens("<|eos|>" * 5) == 0           # an added token spelled in the text is one token


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": BIG, "max_tokens": 8}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}], "max_tokens": 8}),
])
def test_a_prompt_too_big_by_its_bytes_is_refused_before_tokenizing(server, never_tokenized, path, body):
    state = server.app.state.server
    before = state.metrics.refusals.labels("memory")._value.get()
    t0 = time.perf_counter()
    r = httpx.post(server.url + path, json=body, timeout=60)
    took = time.perf_counter() - t0
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["reason"] == "memory_budget"
    assert never_tokenized == [] and took < 5, took
    assert "refused before tokenizing" in err["message"] and "2,100,000 bytes" in err["message"], err
    least = 1_800_000    # 2.1 MB less 300,000 spaces, one byte a token at most
    assert err["max_tokens"] == state.longest and err["prompt_tokens"] == least
    assert err["param"] == ("prompt" if "messages" not in body else "messages")
    assert state.metrics.refusals.labels("memory")._value.get() == before + 1   # counted as admission counts


@pytest.mark.filterwarnings("ignore::mosaic.prompts.LengthWarning")
def test_a_prompt_the_bound_cannot_refuse_is_tokenized_and_refused_as_before(server, never_tokenized):
    """701 tokens (with the BOS): the bound (600, under the ceiling) proves nothing, so admission decides."""
    state = server.app.state.server
    assert state.engine.model.tokenizer.least_tokens("sort 1=" * 100) + 1 <= state.ceiling
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "sort 1=" * 100, "max_tokens": 8}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and never_tokenized == [1]
    assert err["prompt_tokens"] == 701 and "refused before tokenizing" not in err["message"]
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "sort 31415926=", "max_tokens": 8}, timeout=60)
    assert ok.json()["choices"][0]["text"] == "11234569"


def test_token_ids_past_the_ceiling_are_refused_by_their_count(server, never_tokenized):
    state = server.app.state.server
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [3] * (state.ceiling + 1)}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["prompt_tokens"] == state.ceiling + 1 and "token ids" in err["message"]


def test_the_body_is_parsed_off_the_event_loop_and_health_answers_meanwhile(server, monkeypatch):
    """A slow parse (here: one held for 1.5 s) runs on a pool thread, never the loop's."""
    loop_thread, threads = [], []

    def slow(body, model):
        threads.append(threading.current_thread())
        time.sleep(1.5)
        return real(body, model)
    real = api_errors.parse_body
    monkeypatch.setattr(api_errors, "parse_body", slow)
    server.app.state.server.loop.call_soon_threadsafe(lambda: loop_thread.append(threading.current_thread()))
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", httpx.post(
        server.url + "/v1/completions", json={"prompt": "sort 31415926=", "max_tokens": 8}, timeout=60)))
    t.start()
    while not threads:
        time.sleep(0.01)
    t0 = time.perf_counter()
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200
    health_s = time.perf_counter() - t0
    t.join(60)
    assert out["r"].json()["choices"][0]["text"] == "11234569"
    assert threads[0] is not loop_thread[0] and health_s < 1.0, health_s
