"""Load test on loopback, scaled to a 2-core CPU: `mosaic serve` in a subprocess with the bundled
tiny-llada, 16 concurrent clients sending a mix of valid, oversized and malformed requests.

Every valid request is answered (with the right text), every bad one gets a 4xx with a message,
no 5xx; the server's RSS does not grow from one round to the next; the server's own time per
request (outside the queue and the engine) is reported next to the engine's at p50.
MOSAIC_LOAD_REQUESTS sets the requests per client in each of the two measured rounds (default 3;
the issue's target is 100), after a warm-up round of 3. The run is bounded: every request has a
timeout, the server is stopped at the end."""

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from serving import ACTIVATION_BYTES, budgeted_engine, httpx

CLIENTS = 16
PER_CLIENT = int(os.environ.get("MOSAIC_LOAD_REQUESTS", "3"))
WARM = 3
PROMPTS = {"sort 31415926=": "11234569", "sort 4321=": "1234", "sort 907=": "079", "12+30=": "42"}
REPORT = Path(os.environ.get("MOSAIC_LOAD_REPORT", "/tmp/mosaic_load_report.json"))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def served():
    if not Path("/proc/self/status").exists():
        pytest.skip("RSS is read from /proc")
    budget = budgeted_engine().budget.budget_bytes
    port = __import__("mosaic.serve.server", fromlist=["free_port"]).free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "mosaic", "serve", "--device", "cpu", "--budget", f"{budget}B",
                             "--port", str(port), "--log-level", "warning", "--max-model-len", "8192"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.perf_counter() - t0 > 90:
                out = proc.stdout.read() if proc.poll() is not None else ""
                raise RuntimeError(f"mosaic serve did not start: {out}")
            time.sleep(0.1)
        yield url, proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def request_for(i: int, j: int):
    """(kind, method, path, kwargs, expected status) of client i's j-th request."""
    prompt = list(PROMPTS)[(i + j) % len(PROMPTS)]
    kind = ["completion", "oversized", "chat", "malformed_json", "stream", "bad_option"][(i + j) % 6]
    if kind == "completion":
        return kind, "/v1/completions", {"json": {"prompt": prompt, "max_tokens": 8, "steps": 8}}, 200, prompt
    if kind == "chat":
        return kind, "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": prompt}],
                                                       "max_tokens": 8, "steps": 8}}, 200, prompt
    if kind == "stream":
        return kind, "/v1/completions", {"json": {"prompt": prompt, "max_tokens": 8, "steps": 8, "stream": True}}, \
            200, prompt
    if kind == "oversized":
        return kind, "/v1/completions", {"json": {"prompt": prompt, "max_tokens": 4096}}, 400, None
    if kind == "malformed_json":
        return kind, "/v1/completions", {"content": b'{"prompt": "x", ', "headers":
                                         {"content-type": "application/json"}}, 400, None
    # a Dream option on a LLaDA model (top_k is ignored and labelled there, not a 400)
    return kind, "/v1/completions", {"json": {"prompt": prompt, "max_tokens": 8, "alg": "entropy"}}, 400, None


def client_run(url: str, i: int, n: int, out: list):
    with httpx.Client(base_url=url, timeout=120) as c:
        for j in range(n):
            kind, path, kw, want, prompt = request_for(i, j)
            t0 = time.perf_counter()
            if kind == "stream":
                with c.stream("POST", path, **kw) as r:
                    lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                body = json.loads(lines[-2][6:]) if len(lines) >= 2 else {}
                text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1])
                ok = lines[-1] == "data: [DONE]" and text == PROMPTS[prompt]
            else:
                r = c.post(path, **kw)
                body = r.json()
                if want == 200:
                    ch = body["choices"][0]
                    ok = (ch.get("text") or ch.get("message", {}).get("content")) == PROMPTS[prompt]
                else:
                    ok = bool(body.get("error", {}).get("message"))
            out.append({"kind": kind, "status": r.status_code, "want": want, "ok": ok,
                        "latency": time.perf_counter() - t0, "mosaic": body.get("mosaic")})


def load_round(url: str, per_client: int) -> list[dict]:
    out: list[dict] = []
    threads = [threading.Thread(target=client_run, args=(url, i, per_client, out)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60 + 10 * per_client)
    assert not any(t.is_alive() for t in threads), "a client did not finish"
    return out


def test_sixteen_clients_mixed_load(served):
    url, proc = served
    t0 = time.perf_counter()
    warm = load_round(url, WARM)              # warm-up round: templates, allocator, thread pool
    rss_warm = rss_bytes(proc.pid)
    rounds = [load_round(url, PER_CLIENT) for _ in range(2)]
    rss_after = rss_bytes(proc.pid)
    seconds = time.perf_counter() - t0
    results = warm + rounds[0] + rounds[1]
    assert len(results) == CLIENTS * (WARM + 2 * PER_CLIENT)
    wrong = [r for r in results if r["status"] != r["want"] or not r["ok"]]
    assert not wrong, wrong[:5]
    assert not [r for r in results if r["status"] >= 500]
    plain = [r for r in rounds[0] + rounds[1] if r["want"] == 200 and r["kind"] != "stream"]
    engine = statistics.median(r["mosaic"]["engine_seconds"] for r in plain)
    server = statistics.median(r["mosaic"]["server_seconds"] for r in plain)
    admission = statistics.median(r["mosaic"]["admission_seconds"] for r in plain)
    # what a client sees beyond queueing and the engine: HTTP, JSON, threads, the loopback
    client = statistics.median(r["latency"] - r["mosaic"]["queue_seconds"] - r["mosaic"]["engine_seconds"]
                               for r in plain)
    metrics = httpx.get(url + "/metrics").text
    report = {"clients": CLIENTS,
              "requests_per_client": {"warm_up": WARM, "round_1": PER_CLIENT, "round_2": PER_CLIENT},
              "requests": len(results), "seconds": seconds,
              "by_kind": {k: sum(r["kind"] == k for r in results) for k in {r["kind"] for r in results}},
              "server_errors": 0, "rss_after_warmup_bytes": rss_warm, "rss_after_bytes": rss_after,
              "rss_growth_bytes": rss_after - rss_warm, "engine_p50_s": engine, "server_overhead_p50_s": server,
              "server_overhead_share_p50": server / engine,
              "admission_p50_s": admission, "client_side_overhead_p50_s": client,
              "activation_bytes": ACTIVATION_BYTES}
    REPORT.write_text(json.dumps(report, indent=1))
    print("\nload test:", json.dumps(report))
    assert 'mosaic_refusals_total{reason="memory"}' in metrics
    # no growth once warm: two more rounds within 8 MiB of RSS
    assert rss_after - rss_warm < 8 * 2**20, report
    # the target is 5% at p50; 16 client threads, the server and other work share 2 cores
    # here (the GIL and the cores are contended), so the bound is loose
    assert server < 0.5 * engine, report
