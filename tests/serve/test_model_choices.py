"""A model's choice is never a server error: a LLaDA2 model that commits its mask id as a token
(the published generate() keeps it; Mosaic's generate() returns it, and decoding drops it) is
answered as generate() answers, streaming or not. The server used to answer 500 ("the sampler
ended with masked positions left")."""

import torch
from conftest import random_model
from fastapi.testclient import TestClient
from serving import events

from mosaic import MosaicEngine
from mosaic.serve.app import create_app

PROMPT = [3, 4, 5, 6, 7]
BODY = {"prompt": PROMPT, "max_tokens": 8, "block_length": 4, "steps": 2, "seed": 1, "return_token_ids": True}


def mask_choosing_engine() -> MosaicEngine:
    model = random_model("llada2")
    with torch.no_grad():
        model.lm_head[model.cfg.mask_id] += 50.0       # the mask id wins every position
    return MosaicEngine(model, {"progress": False, "memory_budget": model.weight_bytes() + 2**30})


def test_a_model_that_emits_the_mask_id_is_answered_as_generate_answers():
    engine = mask_choosing_engine()
    out = engine.generate(PROMPT, max_new_tokens=8, block_length=4, steps=2, seed=1)
    assert (out.tokens == engine.model.cfg.mask_id).any()
    with TestClient(create_app(engine)) as c:
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == out.text
        with c.stream("POST", "/v1/completions", json=BODY | {"stream": True}) as s:
            got = events(s)
        assert s.status_code == 200 and got[-1] == "[DONE]" and not any("error" in e for e in got[:-1])
        assert "".join(e["choices"][0]["text"] for e in got[:-1]) == out.text
