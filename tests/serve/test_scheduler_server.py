"""The server and generate() share the Scheduler: for every sampler the server's answer is built
from the run's Generation (steps, steps_run, stats) and its tokens are generate()'s, also when
the requests arrive together and run as one continuous batch."""

import json
import threading

import pytest
from conftest import random_model
from serving import budgeted_engine, httpx

from mosaic import MosaicEngine
from mosaic.serve.server import ServerThread

PROMPTS = ["sort 31415926=", "sort 90210733=", "57+384="]   # the first two fill their 8-token canvas
CASES = {
    "exact": dict(steps=8),
    "semi-ar": dict(steps=8, block_length=4),
    "sampled": dict(steps=8, temperature=0.7),
    "threshold": dict(steps=8, block_length=4, threshold=0.9),
    "dual": dict(steps=8, block_length=4, cache="dual", threshold=0.9),
    "prefix": dict(steps=8, block_length=4, cache="prefix", threshold=0.9),
    "speculative": dict(steps=8, speculate=4),
}
DREAM_CASES = {
    "maskgit": dict(steps=8, alg="maskgit_plus"),
    "entropy": dict(steps=8, alg="entropy"),
    "sampled": dict(steps=8, temperature=0.7, top_p=0.9),
    "dual": dict(steps=8, block_length=4, cache="dual", threshold=0.9),
    "speculative": dict(steps=8, speculate=4),
}


BLOCK_CASES = {     # block diffusion (LLaDA2): a random model, token-id prompts
    "greedy": dict(steps=8, block_length=4),
    "sampled": dict(steps=8, block_length=4, temperature=0.7),
}


@pytest.fixture(scope="module")
def served():
    engine = budgeted_engine()
    with ServerThread(engine, timeout=60) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        yield engine, c


@pytest.fixture(scope="module")
def served_dream():
    engine = MosaicEngine("tiny-dream", {"device": "cpu", "progress": False})
    with ServerThread(engine, timeout=60) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        yield engine, c


@pytest.fixture(scope="module")
def served_llada2():
    engine = MosaicEngine(random_model("llada2"), {"progress": False})
    with ServerThread(engine, timeout=60) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        yield engine, c


def _post(c, prompt, opts, seed):
    body = {"prompt": prompt, "max_tokens": 8, "seed": seed, "return_token_ids": True, **opts}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _expect(engine, prompt, opts, seed):
    out = engine.generate(prompt, max_new_tokens=8, seed=seed, **opts)
    ids = out.tokens[0].tolist()
    eos = engine.model.cfg.eos_id
    return out, ids[:ids.index(eos)] if eos in ids else ids


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_servers_answer_is_the_generation_of_the_same_run(served, case):
    _same_run(*served, CASES[case], case)


@pytest.mark.parametrize("case", sorted(DREAM_CASES))
def test_the_servers_answer_is_the_generation_of_the_same_run_dream(served_dream, case):
    _same_run(*served_dream, DREAM_CASES[case], case)


@pytest.mark.parametrize("case", sorted(BLOCK_CASES))
def test_the_servers_answer_is_the_generation_of_the_same_run_block_diffusion(served_llada2, case):
    """LLaDA2's block sampler through the server: its steps, stats and tokens are generate()'s,
    sent alone and sent together with another request."""
    engine, c = served_llada2
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    _same_run(engine, c, BLOCK_CASES[case], case, prompts)
    got = {}
    threads = [threading.Thread(target=lambda i=i, p=p: got.update({i: _post(c, p, BLOCK_CASES[case], 5 + i)}))
               for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, p in enumerate(prompts):
        assert got[i]["mosaic"]["token_ids"] == _expect(engine, p, BLOCK_CASES[case], 5 + i)[1], (case, p)


def _same_run(engine, c, opts, case, prompts=PROMPTS[:2]):
    for i, prompt in enumerate(prompts):       # no early stop: the same run as generate()'s
        out, ids = _expect(engine, prompt, opts, seed=11 + i)
        body = _post(c, prompt, opts, seed=11 + i)
        mos = body["mosaic"]
        assert mos["token_ids"] == ids, (case, prompt)
        assert body["choices"][0]["text"] == out.text
        assert not mos["stopped_early"] and (mos["steps"], mos["steps_run"]) == (out.steps, out.steps_run), case
        assert mos["stats"] == json.loads(json.dumps(out.stats)) and mos["lossy"] == out.lossy


def test_requests_that_arrive_together_get_generates_tokens(served):
    """Every case and prompt at once: they share steps in the server's batch, each with its own
    random stream, and each gets the tokens generate() gives it alone."""
    engine, c = served
    jobs = [(case, p, 100 + i) for case in sorted(CASES) for i, p in enumerate(PROMPTS)]
    got = {}

    def send(job):
        case, p, seed = job
        got[job] = _post(c, p, CASES[case], seed)["mosaic"]["token_ids"]
    threads = [threading.Thread(target=send, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for job in jobs:
        case, p, seed = job
        assert got[job] == _expect(engine, p, CASES[case], seed)[1], job
