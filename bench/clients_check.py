"""Third-party OpenAI clients against `mosaic serve`: the openai SDK, litellm,
LangChain's ChatOpenAI and guidellm's default streaming benchmark, each run against a local
server on 127.0.0.1 with the bundled tiny-llada (CPU), an API key required.

Not a test: the clients are large (litellm, langchain and guidellm with its torch and
transformers: ~1.8 GB in a venv), so they live in their own environment:

    python -m venv .venv-clients
    .venv-clients/bin/pip install torch==2.13.0 -e ".[serve]" openai litellm langchain-openai guidellm
    .venv-clients/bin/python bench/clients_check.py --out bench/results/clients_cpu

Writes OUT.log (every check, what it saw, the installed versions) and OUT.json; prints a table
last. A client that is not installed is reported as such. Bounded: every request has a timeout,
guidellm runs 8 requests, the server is stopped (SIGTERM) at the end, its exit code checked."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY = "clients-check-key"
MODEL = "tiny-llada"
CHAT = [{"role": "user", "content": "sort 4321="}]
WANT = "1234"
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # litellm: no download of its cost map


def version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def start_server(port: int, log_path: Path) -> subprocess.Popen:
    """`mosaic serve` under the tests' budget: the weights and workspace + 1 MB of activations
    (~420 tokens of tiny-llada), so that a 100k-token request is a context overflow (under the
    default budget, the host's free memory, it would fit and run for many minutes on a CPU)."""
    import httpx

    from mosaic import MosaicEngine
    budget = MosaicEngine(MODEL, {"device": "cpu"}).budget.fixed_bytes + 1_000_000
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MOSAIC_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "mosaic", "serve", "--device", "cpu", "--port", str(port),
                             "--budget", f"{budget}B", "--log-level", "warning"], env=env,
                            stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 120:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"mosaic serve did not start: {log_path.read_text()}")


# -- the checks: each returns a short description of what it saw, or raises
def openai_checks(url: str) -> dict:
    import openai
    out = {}
    with openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60) as c:
        r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, top_p=0.95)
        assert r.choices[0].message.content == WANT, r
        out["sync chat"] = f"{r.choices[0].message.content!r}, finish {r.choices[0].finish_reason}"
        chunks = list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == WANT and chunks[-1].usage is not None, chunks
        out["streaming chat"] = f"{text!r} in {len(chunks)} chunks, usage {chunks[-1].usage.completion_tokens}"
        try:
            c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=100_000)
            raise AssertionError("a 100k-token canvas was admitted")
        except openai.BadRequestError as e:
            assert e.code == "context_length_exceeded", e
            out["context overflow"] = f"BadRequestError code={e.code}"

    async def run():
        async with openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60) as c:
            rs = await asyncio.gather(*(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8)
                                        for _ in range(4)))
        return [r.choices[0].message.content for r in rs]
    answers = asyncio.run(run())
    assert answers == [WANT] * 4, answers
    out["async chat x4"] = f"{answers}"
    return out


def litellm_checks(url: str) -> dict:
    import litellm
    out = {}
    kw = {"model": f"openai/{MODEL}", "api_base": url, "api_key": KEY, "timeout": 60, "num_retries": 0}
    r = litellm.completion(messages=CHAT, max_tokens=8, **kw)
    assert r.choices[0].message.content == WANT, r
    out["completion"] = f"{r.choices[0].message.content!r}"
    text = "".join(ch.choices[0].delta.content or "" for ch in litellm.completion(messages=CHAT, max_tokens=8,
                                                                                   stream=True, **kw))
    assert text == WANT, text
    out["streaming"] = f"{text!r}"
    try:
        litellm.completion(messages=CHAT, max_tokens=100_000, **kw)
        raise AssertionError("a 100k-token canvas was admitted")
    except litellm.ContextWindowExceededError as e:
        out["context overflow"] = f"{type(e).__name__}"
    return out


def langchain_checks(url: str) -> dict:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel
    out = {}
    llm = ChatOpenAI(model=MODEL, base_url=url, api_key=KEY, max_tokens=8, max_retries=0, timeout=60)
    msg = llm.invoke("sort 4321=")
    assert msg.content == WANT, msg
    out["invoke"] = f"{msg.content!r}"
    text = "".join(ch.content for ch in llm.stream("sort 4321="))
    assert text == WANT, text
    out["stream"] = f"{text!r}"

    class Answer(BaseModel):
        digits: str
    tool = {"type": "function", "function": {"name": "sort", "description": "sort digits",
                                             "parameters": {"type": "object", "properties": {}}}}
    msg = llm.bind_tools([tool], tool_choice="auto").invoke("sort 4321=")
    assert msg.content == WANT and not msg.tool_calls, msg
    out["bind_tools (tool_choice auto)"] = f"accepted, answered in text {msg.content!r} (tools ignored, labelled)"
    # response_format json_schema: the server answers 200 and labels the field ignored; the
    # model's text is not an Answer object, which LangChain's parser then says (client side)
    try:
        res = llm.with_structured_output(Answer, include_raw=True).invoke("sort 4321=")
        parsed = f"parsed {res['parsed']!r}, parsing_error {type(res['parsing_error']).__name__}"
    except Exception as e:  # the json_schema parser raises even with include_raw
        parsed = f"LangChain's parser raised {type(e).__name__} ({str(e).splitlines()[0]})"
    out["with_structured_output"] = f"HTTP 200 (response_format ignored, labelled); {parsed}"
    return out


def guidellm_check(url: str, work: Path) -> dict:
    """guidellm's default: chat completions, streaming with include_usage and
    continuous_usage_stats; a JSON-lines file of prompts the tiny model's tokenizer covers."""
    data = work / "prompts.jsonl"
    prompts = ["sort 31415926=", "sort 4321=", "sort 907=", "12+30="]
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts * 2))
    exe = Path(sys.executable).with_name("guidellm")
    env = {**os.environ, "GUIDELLM__OPENAI__API_KEY": KEY}
    cmd = [str(exe), "run", "--backend", f"kind=openai_http,target={url.removesuffix('/v1')},api_key={KEY}",
           "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=8",
           "--data", f"kind=json_file,path={data}", "--output", f"kind=json,path={work / 'guidellm.json'}",
           "--disable-progress"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=work, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    bench = json.loads((work / "guidellm.json").read_text())["benchmarks"][0]
    made = bench["scheduler_metrics"]["requests_made"]
    fmt = bench["config"]["backend"].get("request_format", "?") if isinstance(bench["config"].get("backend"),
                                                                             dict) else "?"
    assert made["successful"] == 8 and made["errored"] == 0, made
    return {"synchronous x8": f"requests {made} (request format {fmt})"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/clients_cpu", help="writes OUT.log and OUT.json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from mosaic.serve.server import free_port

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    versions = {n: version(n) for n in ("mosaic-dllm", "openai", "litellm", "langchain-openai", "langchain-core",
                                        "guidellm", "fastapi", "uvicorn", "torch")}
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server_log = work / "server.log"
        proc = start_server(port, server_log)
        try:
            for name, pkg, check in (("openai", "openai", lambda: openai_checks(url)),
                                     ("litellm", "litellm", lambda: litellm_checks(url)),
                                     ("langchain-openai", "langchain-openai", lambda: langchain_checks(url)),
                                     ("guidellm", "guidellm", lambda: guidellm_check(url, work))):
                t0 = time.perf_counter()
                if versions[pkg] == "not installed":
                    results[name] = {"ok": None, "detail": "not installed"}
                    continue
                try:
                    results[name] = {"ok": True, "detail": check()}
                except Exception as e:  # every client is tried; what failed is written down
                    results[name] = {"ok": False, "detail": f"{type(e).__name__}: {e}",
                                     "traceback": traceback.format_exc(limit=4)}
                results[name]["seconds"] = round(time.perf_counter() - t0, 2)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = "killed after 60 s"
        log_text = server_log.read_text()
    record = {"commit": commit, "python": platform.python_version(), "platform": platform.platform(),
              "versions": versions, "results": results, "server_exit_code": code,
              "server_log_warnings": [ln for ln in log_text.splitlines() if ln.startswith(("WARNING", "ERROR"))]}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    lines = [f"clients against mosaic serve ({MODEL}, CPU, API key required), commit {commit}, "
             f"python {record['python']}", "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), ""]
    for name, r in results.items():
        state = {True: "OK", False: "FAILED", None: "SKIPPED"}[r["ok"]]
        lines.append(f"{name}: {state}" + (f" ({r['seconds']} s)" if "seconds" in r else ""))
        detail = r["detail"]
        for k, v in (detail.items() if isinstance(detail, dict) else [("", detail)]):
            lines.append(f"  {k}: {v}" if k else f"  {v}")
        if r.get("traceback"):
            lines.append("  " + r["traceback"].replace("\n", "\n  "))
    lines += ["", f"server exit code after SIGTERM: {code}", "server warnings (each ignored field once):"]
    lines += [f"  {w}" for w in record["server_log_warnings"]]
    out.with_suffix(".log").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:2]))
    print(f"\n{'client':<18} {'result':<8} seconds")
    for name, r in results.items():
        print(f"{name:<18} {({True: 'OK', False: 'FAILED', None: 'SKIPPED'})[r['ok']]:<8} {r.get('seconds', '-')}")
    return 0 if all(r["ok"] is not False for r in results.values()) and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
