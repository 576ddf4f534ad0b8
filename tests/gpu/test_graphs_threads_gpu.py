"""Captured steps on a thread other than the one that warmed the engine up, on the GPU (skipped
without CUDA): what `mosaic serve` does. On the H200 the served request's captures failed
(cudaErrorStreamCaptureInvalidated, then "beginAllocateToPool: already recording") and it ran
eager at 0.20x generate() (bench/results/gpu/session7/everyday_2a23023.log). The first run of
a shape on a thread is eager (its libraries' per-thread handles made outside any capture), a
capture runs alone (memory/capture_guard.py: no other thread's device-wide call, no garbage
collector's finalizer inside it), and a failed capture gives up its pool."""

import gc
import json
import threading

import pytest
import torch
from conftest import needs_cuda

from mosaic import MosaicEngine, load

pytestmark = [pytest.mark.gpu, needs_cuda]
KW = dict(max_new_tokens=64, steps=64, block_length=16, cache="dual", threshold=0.9)


@pytest.fixture(scope="module")
def llada():
    return load("llada-8b", device="cuda", num_layers=2)


def _prompt(n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=g).tolist()


def _served_engine(model):
    """The engine as `mosaic serve` makes it (a budget: the free memory at start)."""
    from mosaic.config import EngineConfig
    from mosaic.serve.commands import default_budget
    gc.collect()
    torch.cuda.empty_cache()
    econf, _ = default_budget(EngineConfig.coerce({"progress": False, "device": "cuda"}))
    return MosaicEngine(model, econf)


def _garbage(model, prompt):
    """An engine dropped without close(): its arena goes whenever the cyclic collector runs, on
    whichever thread (the served benchmark left one behind)."""
    junk = MosaicEngine(model, {"progress": False})
    junk.generate(prompt, **KW)
    junk.cycle = junk        # collected only by the cyclic collector


def _ok(g):
    return g["mode"] == "captured" and g["replays"] > 0 and g["failures"] == 0


def test_a_second_thread_captures_its_own_steps_with_the_main_threads_tokens(llada):
    prompt = _prompt()
    eng = _served_engine(llada)
    want = [eng.generate(prompt, **KW) for _ in range(2)][-1]
    assert _ok(want.stats["graphs"]), want.stats["graphs"]
    eng.graphs.drop_graphs()     # the other thread meets seen shapes with no graph: it must capture
    _garbage(llada, prompt)
    outs = []
    t = threading.Thread(target=lambda: outs.extend(eng.generate(prompt, **KW) for _ in range(3)))
    t.start()
    t.join()
    assert len(outs) == 3 and all(torch.equal(o.tokens, want.tokens) for o in outs)
    g = outs[-1].stats["graphs"]
    assert _ok(g) and g["eager"] == 0, g
    st = eng.graphs.stats
    assert not st.failures and st.captures > 0, st.as_dict()


def test_a_served_streaming_request_is_captured_with_generates_tokens(llada):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from mosaic.serve.server import ServerThread
    prompt = _prompt(seed=1)
    eng = _served_engine(llada)
    want = [eng.generate(prompt, **KW) for _ in range(2)][-1]     # the main thread's captures
    _garbage(llada, prompt)
    body = {"prompt": prompt, "max_tokens": 64, "block_length": 16, "steps": 64, "cache": "dual", "threshold": 0.9}

    def streamed(client, url):
        last = None
        with client.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as r:
            assert r.status_code == 200, r.read()[:300]
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[6:]).get("mosaic") or last
        return last
    with ServerThread(eng, max_batch=1, request_timeout=None) as srv, httpx.Client(timeout=600) as client:
        streamed(client, srv.url)                                   # the engine thread's first runs
        extra = streamed(client, srv.url)
        r = client.post(f"{srv.url}/v1/completions", json=body | {"return_token_ids": True})
    g = extra["stats"]["graphs"]
    assert _ok(g) and g["eager"] == 0, g
    assert not eng.graphs.stats.failures, eng.graphs.stats.as_dict()
    ids = r.json()["mosaic"]["token_ids"]
    assert ids and ids == want.tokens[0].tolist()[:len(ids)]
