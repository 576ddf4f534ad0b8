"""Closed and robust by default: the API key, every serve flag checked, the default
budget, request timeouts, and SIGTERM / SIGINT during a request (a `mosaic serve` subprocess on
127.0.0.1 that stops by itself)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from serving import PAST_TRAINED, budgeted_engine, httpx

from mosaic.cli import main
from mosaic.config import EngineConfig
from mosaic.loader import host_available_bytes
from mosaic.serve.commands import default_budget
from mosaic.serve.server import ServerThread, free_port

SORT = {"prompt": "sort 31415926=", "max_tokens": 8, "steps": 8}
LONG = {"prompt": "sort 31415926=", "max_tokens": 96, "steps": 96}   # ~1-3 s on the CPU
ROOT = Path(__file__).parents[2]


def test_api_key_guards_the_api():
    """As vLLM: the API needs the key, probes and the scraper do not (/health, /ping, /version,
    /metrics: --protect-metrics guards it too, test_vllm_surface.py)."""
    with ServerThread(budgeted_engine(), max_model_len=PAST_TRAINED, api_key="s3cret", timeout=60) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.get("/health").status_code == 200 and c.get("/health").json()["auth"] is True
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
                                 ("GET", "/v1/models/tiny-llada"), ("GET", "/v1/nowhere")):
                r = c.request(method, path, headers=headers, json=SORT)
                assert r.status_code == 401, (method, path, headers)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
                assert "Authorization: Bearer" in err["message"] and r.headers["www-authenticate"] == "Bearer"
        ok = {"Authorization": "Bearer s3cret"}
        assert c.get("/v1/models", headers=ok).status_code == 200
        assert c.post("/v1/completions", headers=ok, json=SORT).json()["choices"][0]["text"] == "11234569"
        assert 'endpoint="/v1/completions",status="401"' in c.get("/metrics").text
        assert c.get("/nowhere").status_code == 404 and c.get("/ping").status_code == 200


@pytest.mark.parametrize("args, message", [
    (["--max-queue", "0"], "argument --max-queue: must be at least 1, got 0"),
    (["--max-queue", "-1"], "must be at least 1, got -1"),
    (["--request-timeout", "0"], "argument --request-timeout: must be more than 0 seconds"),
    (["--request-timeout", "nan"], "must be more than 0 seconds"),
    (["--request-timeout", "soon"], "'soon' is not a number of seconds"),
    (["--shutdown-timeout", "-1"], "argument --shutdown-timeout: must be 0 or more seconds"),
    (["--api-key", " "], "argument --api-key: empty"),
    (["--port", "70000"], "out of range"),
    (["--host", ""], "argument --host: empty"),
    (["--served-model-name", ""], "argument --served-model-name: empty"),
])
def test_every_serve_flag_is_checked(capsys, args, message):
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("host, busy, message", [
    ("999.1.1.1", False, "--host '999.1.1.1' is not an address this machine can listen on"),
    ("127.0.0.1", True, "Address already in use (another process is listening there"),
])
def test_a_host_or_port_it_cannot_listen_on_is_one_error_before_the_model_loads(capsys, monkeypatch, host, busy,
                                                                                 message):
    """It used to load the model, log its start, then fail with [Errno -2] / [Errno 98] and exit 3."""
    import socket

    from mosaic.serve import commands

    def never(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(commands, "MosaicEngine", never)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1] if busy else 0
        assert main(["serve", "--host", host, "--port", str(port), "--budget", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_the_default_budget_is_what_the_host_has_free():
    before = host_available_bytes()
    econf, source = default_budget(EngineConfig(device="cpu"))
    assert abs(econf.memory_budget - before) < 512 * 2**20 and "MemAvailable" in source
    given = EngineConfig(device="cpu", memory_budget="1GiB")
    assert default_budget(given) == (given, "--budget / the engine config")


def test_a_request_past_the_timeout_is_cancelled_and_answered_504():
    with ServerThread(budgeted_engine(), max_model_len=PAST_TRAINED, request_timeout=0.3, timeout=60) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        state = srv.app.state.server
        r = c.post("/v1/completions", json=LONG)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        assert r.headers["x-should-retry"] == "false"      # the openai SDK would retry a 504
        with c.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as s:
            last = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")][-1]
        assert last["error"]["code"] == "request_timeout"
        t0 = time.perf_counter()
        while len(state.cancelled) < 2 and time.perf_counter() - t0 < 30:
            time.sleep(0.02)
        assert len(state.cancelled) == 2 and all(steps < 96 for steps in state.cancelled)   # stopped between steps
        # the worker still serves after the cancellations: a generous timeout for this one, so that a
        # busy machine (SORT takes ~0.1 s alone) cannot turn it into a third 504
        state.request_timeout = 60
        r = c.post("/v1/completions", json=SORT)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "11234569", r.text
        assert len(state.cancelled) == 2


def _serve(env_key: str | None = None, max_model_len: int = PAST_TRAINED):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if env_key:
        env["MOSAIC_API_KEY"] = env_key
    proc = subprocess.Popen([sys.executable, "-m", "mosaic", "serve", "--device", "cpu", "--port", str(port),
                             "--log-level", "info", "--max-model-len", str(max_model_len)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.perf_counter() - t0 > 90:
            proc.kill()
            raise RuntimeError(f"mosaic serve did not start: {proc.communicate()[0]}")
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_during_a_request_cancels_it_and_exits_0(sig):
    """No --budget: the server admits against the host's free memory (logged, in /health); the
    key comes from MOSAIC_API_KEY. A signal while a stream runs: the stream ends with a 503
    shutting_down error at the next step, the process exits 0 (it used to abort, exit 134)."""
    proc, url = _serve(env_key="k3y")
    try:
        health = httpx.get(url + "/health", timeout=5).json()
        assert health["budget_bytes"] > 0 and "MemAvailable" in health["budget_source"] and health["auth"]
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 401
        got, started = [], threading.Event()

        def stream():
            with httpx.stream("POST", url + "/v1/completions", timeout=60, headers={"Authorization": "Bearer k3y"},
                              json={"prompt": "sort 31415926=", "max_tokens": 160, "steps": 160, "stream": True,
                                    "stream_canvas": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got.append(line[6:])
                        started.set()
        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        proc.send_signal(sig)
        t0 = time.perf_counter()
        out, _ = proc.communicate(timeout=60)
        t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 0, out
    assert time.perf_counter() - t0 < 30
    assert "budget" in out and "free host memory at start" in out
    assert "terminate called" not in out and "Traceback" not in out, out
    errors = [json.loads(g)["error"] for g in got if g.startswith('{"error"')]
    assert got[-1] == "[DONE]" and errors and errors[0]["code"] == "shutting_down", got[-3:]


@pytest.mark.slow
def test_a_signal_during_one_long_step_stops_it_inside_the_step():
    """A step of a 32,768-token canvas takes longer on the CPU than the whole test may: the
    signal stops it after the op that is running (Ctx.interrupt), the client gets its 503 and the
    process exits 0 within seconds (before in-step cancellation: 106 s and a 500)."""
    proc, url = _serve(max_model_len=40_000)        # past the trained length on purpose
    res = {}
    try:
        def post():
            r = httpx.post(url + "/v1/completions", timeout=120,
                           json={"prompt": "sort 31415926=", "max_tokens": 32768, "steps": 64})
            res["status"], res["body"] = r.status_code, r.json()
        t = threading.Thread(target=post)
        t.start()
        time.sleep(8)                                   # inside the first step
        proc.send_signal(signal.SIGINT)
        t0 = time.perf_counter()
        out, _ = proc.communicate(timeout=90)
        took = time.perf_counter() - t0
        t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 0 and "Traceback" not in out, out
    assert took < 30, took
    assert res["status"] == 503 and res["body"]["error"]["code"] == "shutting_down", res
