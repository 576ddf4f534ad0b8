"""vLLM's max_model_len rule: the server accepts prompt + max_tokens up to the length the model was
trained for unless the operator raises it (--max-model-len), answers longer requests with 400
context_length_exceeded, and says the memory capacity separately (capacity_tokens). It used to
advertise the memory capacity (9,772,980 tokens for tiny-llada, trained on 64) as max_model_len
and answer longer requests 200 with wrong text."""

import pytest
from fastapi.testclient import TestClient
from serving import budgeted_engine

from mosaic.errors import MosaicError
from mosaic.serve.app import create_app

LONG = {"prompt": "sort 31415926=", "max_tokens": 64, "steps": 4}     # 15 + 64 tokens: past the trained 64


@pytest.fixture(scope="module")
def engine():
    return budgeted_engine()


def test_the_default_is_the_trained_length(engine):
    with TestClient(create_app(engine)) as c:
        health, card = c.get("/health").json(), c.get("/v1/models").json()["data"][0]
        assert health["max_model_len"] == card["max_model_len"] == card["trained_length"] == 64
        assert health["capacity_tokens"] == card["capacity_tokens"] > 64      # the memory's figure, apart
        r = c.post("/v1/completions", json=LONG)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["reason"] == "max_model_len"
        assert err["max_tokens"] == 64 and err["requested_tokens"] == 79 and "--max-model-len" in err["message"]
        ok = c.post("/v1/completions", json={"prompt": "sort 31415926=", "max_tokens": 8, "steps": 8}).json()
        assert ok["choices"][0]["text"] == "11234569" and ok["mosaic"]["beyond_trained_length"] is False
        assert 'mosaic_refusals_total{reason="max_model_len"} 1.0' in c.get("/metrics").text


def test_the_operator_may_raise_it_and_the_answer_says_so(engine):
    with TestClient(create_app(engine, max_model_len=128)) as c:
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 128
        body = c.post("/v1/completions", json=LONG).json()
        assert body["mosaic"]["beyond_trained_length"] is True
        assert c.post("/v1/completions", json=LONG | {"max_tokens": 120}).status_code == 400


def test_a_max_model_len_above_max_seq_len_is_refused():
    with pytest.raises(MosaicError, match="--max-model-len 100 is more than --max-seq-len .max_length. 32"):
        create_app(budgeted_engine(max_seq_len=32), max_model_len=100)
