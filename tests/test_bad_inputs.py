"""Bad input across the Python API, the command line, the server and `python -m bench`: one
table, each row an input a user may give and a piece of the one clear error it must get. A
row fails on a traceback (any exception that is not Mosaic's own error, a 500, a CLI exit that
is not one `error:` line with code 2) and on a silent acceptance (no error at all)."""

import json
import shutil
import warnings

import pytest
import torch
from conftest import bundled

from mosaic import MosaicEngine
from mosaic.errors import MosaicError

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from mosaic.serve.app import create_app  # noqa: E402

SORT = "sort 907="
USER = [{"role": "user", "content": "sort 321"}]


@pytest.fixture(scope="module")
def engine():
    return MosaicEngine(str(bundled("tiny-llada")), {"device": "cpu", "progress": False})


def closed_engine():
    e = MosaicEngine("tiny-llada", {"device": "cpu", "progress": False})
    e.close()
    return e


# -- the Python API: (what is wrong, call(engine), a piece of the message)
API = [
    ("chat not a bool", lambda e: e.generate(SORT, chat="yes"), "chat must be True or False"),
    ("progress not a bool", lambda e: e.generate(SORT, progress="loud"), "progress must be True, False or None"),
    ("native not a bool", lambda e: e.generate(SORT, native="yes"), "native must be True, False or None"),
    ("an unknown role", lambda e: e.generate([{"role": "wizard", "content": "1"}]), "allowed roles"),
    ("a message without a role", lambda e: e.generate([{"content": "1"}]), "must be an object with a role"),
    ("a message with numeric content", lambda e: e.generate([{"role": "user", "content": 3}]), "text content"),
    ("an empty model name", lambda e: MosaicEngine(""), "no model named"),
    ("no model at all", lambda e: MosaicEngine(None), "got NoneType"),
    ("a folder that is not there", lambda e: MosaicEngine("/no/such/folder"), "does not exist"),
    ("a hub id", lambda e: MosaicEngine("GSAI-ML/LLaDA-8B-Instruct"), "hf download"),
    ("a budget below the weights", lambda e: MosaicEngine("tiny-llada", {"device": "cpu", "memory_budget": "64MiB"}),
     "refused before loading"),
    ("a dtype that does not exist", lambda e: MosaicEngine("tiny-llada", {"device": "cpu", "dtype": "float7"}),
     "float7"),
    ("an unknown engine option", lambda e: MosaicEngine("tiny-llada", {"device": "cpu", "colour": 1}), "colour"),
    ("a budget that is no size", lambda e: MosaicEngine("tiny-llada", {"device": "cpu", "memory_budget": "lots"}),
     "lots"),
    ("a device that is not there", lambda e: MosaicEngine("tiny-llada", {"device": "tpu"}), "tpu"),
    ("chunks of zero", lambda e: MosaicEngine("tiny-llada", {"device": "cpu", "chunks": (0, 1, 1)}), "chunks"),
    ("an unknown batched attention kernel",
     lambda e: MosaicEngine("tiny-llada", {"device": "cpu", "varlen_kernel": "paged"}), "varlen_kernel='paged'"),
    ("a batched attention kernel a CPU cannot run",
     lambda e: MosaicEngine("tiny-llada", {"device": "cpu", "varlen_kernel": "flash"}), "'flash' cannot run"),
    ("a batched attention kernel that is not batch-invariant",
     lambda e: MosaicEngine("tiny-llada", {"device": "cpu", "varlen_kernel": "gather", "batch_invariant": True}),
     "not batch-invariant"),
    ("an unknown transient pool",
     lambda e: MosaicEngine("tiny-llada", {"device": "cpu", "transient_pool": "huge"}), "transient_pool='huge'"),
    ("steps without end", lambda e: e.generate(SORT, max_new_tokens=8, steps=10**9), "at most 8"),
    ("zero steps", lambda e: e.generate(SORT, steps=0), "steps"),
    ("no new tokens", lambda e: e.generate(SORT, max_new_tokens=0), "max_new_tokens"),
    ("negative new tokens", lambda e: e.generate(SORT, max_new_tokens=-1), "max_new_tokens"),
    ("new tokens as text", lambda e: e.generate(SORT, max_new_tokens="8"), "max_new_tokens"),
    ("a negative temperature", lambda e: e.generate(SORT, temperature=-1), "temperature"),
    ("a negative seed", lambda e: e.generate(SORT, seed=-1), "seed"),
    ("a seed past 64 bits", lambda e: e.generate(SORT, seed=2**64), "seed"),
    ("an empty prompt", lambda e: e.generate(""), "empty"),
    ("no prompt", lambda e: e.generate([]), "prompt"),
    ("ids outside the vocabulary", lambda e: e.generate([10**6]), "outside the vocabulary"),
    ("the mask id in a prompt", lambda e: e.generate([5, 19, 6]), "mask token"),
    ("characters the vocabulary lacks", lambda e: e.generate("sort ä"), "cannot encode"),
    ("a float prompt", lambda e: e.generate(3.5), "prompt"),
    ("a float tensor prompt", lambda e: e.generate(torch.ones(1, 3)), "integer token ids"),
    ("a 3-d tensor prompt", lambda e: e.generate(torch.ones(1, 1, 3, dtype=torch.long)), "shape"),
    ("a mask ratio of 2", lambda e: e.generate(SORT, mask_ratio=2), "mask_ratio"),
    ("a mask ratio of 0", lambda e: e.generate(SORT, mask_ratio=0), "mask_ratio"),
    ("an unknown option", lambda e: e.generate(SORT, colour=1), "unknown generation options"),
    ("an engine option as a generation option", lambda e: e.generate(SORT, batch_invariant=True),
     'engine option, not a generation option: pass it to the engine, MosaicEngine(model, {"batch_invariant": True})'),
    ("an engine option's flag", lambda e: e.generate(SORT, fused_projections="all"),
     "`mosaic generate --fused-projections all`"),
    ("engine options as a number", lambda e: MosaicEngine(e.model, 3), "expected an EngineConfig or a dict"),
    ("given steps off the blocks", lambda e: e.generate(SORT, max_new_tokens=12, block_length=4, steps=8),
     "steps 8 must be a positive multiple of the number of blocks"),
    ("a block that does not divide the canvas", lambda e: e.generate(SORT, max_new_tokens=8, block_length=3),
     "block_length"),
    ("another family's option", lambda e: e.generate(SORT, alg="entropy"), "Dream sampler option"),
    ("a negative cfg scale", lambda e: e.generate(SORT, cfg_scale=-1), "cfg_scale"),
    ("an unknown remasking", lambda e: e.generate(SORT, remasking="sideways"), "remasking"),
    ("continue and a generation prompt", lambda e: e.generate(USER, continue_final_message=True,
                                                              add_generation_prompt=True), "cannot both be true"),
    ("chat options on plain text", lambda e: e.generate(SORT, continue_final_message=True), "apply to chat"),
    ("template kwargs not an object", lambda e: e.generate(USER, chat_template_kwargs="x"), "chat_template_kwargs"),
    ("continue an empty message", lambda e: e.generate(USER + [{"role": "assistant", "content": ""}],
                                                       continue_final_message=True), "no text to continue"),
    ("a closed engine", lambda e: closed_engine().generate(SORT), "this engine is closed"),
    ("right padding", lambda e: e.generate(torch.tensor([[5, 6, 7]]), attention_mask=torch.tensor([[1, 1, 0]])),
     "left"),
    ("a prompt twice", lambda e: e.generate(SORT, inputs=SORT), "once"),
    ("a negative speculation", lambda e: e.generate(SORT, speculate=-1), "speculate"),
    ("speculation with sampling", lambda e: e.generate(SORT, speculate=4, temperature=1.0), "temperature"),
    ("an unknown cache", lambda e: e.generate(SORT, cache="x"), "cache"),
    ("a threshold of 2", lambda e: e.generate(SORT, threshold=2), "threshold"),
    ("chat with token ids", lambda e: e.generate([5, 6], chat=True), "token ids"),
    ("a max_length of 0", lambda e: MosaicEngine("tiny-llada", {"device": "cpu", "max_length": 0}), "max_length"),
    ("a request over max_length", lambda e: MosaicEngine(e.model, {"max_length": 12}).generate(SORT, max_new_tokens=8),
     "max_length"),
]


@pytest.mark.parametrize("what, call, words", API, ids=[r[0] for r in API])
def test_the_api_refuses_with_one_clear_error(engine, what, call, words):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(MosaicError) as err:     # any other exception is a traceback; no exception, silence
            call(engine)
    assert words in str(err.value), str(err.value)


def test_a_config_json_dtype_that_does_not_exist(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(bundled("tiny-llada"), folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw | {"torch_dtype": "float7"}))
    with pytest.raises(MosaicError, match="torch_dtype='float7' .not a dtype"):
        MosaicEngine(str(folder), {"device": "cpu"})


# -- the command line: (what is wrong, argv, a piece of the one error line)
GEN = ["generate", "--device", "cpu", "--no-progress"]
CLI = [
    ("steps past the canvas", GEN + ["--steps", "64"], "at most 8"),
    ("no new tokens", GEN + ["--max-new-tokens", "0"], "--max-new-tokens"),
    ("an empty prompt", GEN + ["--prompt", ""], "empty"),
    ("ids that are not numbers", GEN + ["--ids", "1,x"], "whole numbers"),
    ("ids outside the vocabulary", GEN + ["--ids", "99999"], "outside the vocabulary"),
    ("chat with ids", GEN + ["--chat", "--ids", "1,2"], "--chat"),
    ("a model that is not there", GEN + ["--model", "nosuch", "--prompt", "1"], "does not exist"),
    ("a hub id", GEN + ["--model", "GSAI-ML/LLaDA-8B-Instruct", "--prompt", "1"], "hf download"),
    ("a budget that is no size", GEN + ["--budget", "lots"], "lots"),
    ("a budget below the weights", GEN + ["--budget", "64MiB"], "refused before loading"),
    ("a negative temperature", GEN + ["--temperature", "-1"], "temperature"),
    ("a block that does not divide", GEN + ["--block-length", "3"], "block"),
    ("a messages file that is not there", GEN + ["--messages", "/no/such.json"], "--messages"),
    ("continue without a chat", GEN + ["--continue-final-message"], "shape a chat"),
    ("zero processes", GEN + ["--gpus", "0"], "--gpus"),
    ("64 processes on a CPU", GEN + ["--gpus", "64"], "CPU core"),
    ("a plot that is not a picture", GEN + ["--memory-plot", "x.txt"], "--memory-plot"),
    ("a dtype that does not exist", GEN + ["--dtype", "float7"], "float7"),
    ("an unknown batched attention kernel", GEN + ["--varlen-kernel", "paged"], "--varlen-kernel"),
    ("a batched attention kernel a CPU cannot run", GEN + ["--varlen-kernel", "flash"], "'flash' cannot run"),
    ("an unknown transient pool", GEN + ["--transient-pool", "huge"], "--transient-pool"),
    ("another family's option", GEN + ["--alg", "entropy"], "--alg"),
    ("a prompt file that is not there", GEN + ["--prompt-file", "/no/such.txt"], "--prompt-file"),
    ("a config file that is not there", GEN + ["--config", "/no/such.yaml"], "such.yaml"),
    ("plan without a size", ["plan"], "--tokens"),
    ("plan with a budget that is no size", ["plan", "--budget", "lots"], "lots"),
    ("plan with zero tokens", ["plan", "--tokens", "0"], "--tokens"),
    ("plan of a model that is not there", ["plan", "--model", "nosuch", "--budget", "1GiB"], "nosuch"),
    ("masked more than tokens", ["plan", "--tokens", "8", "--masked", "9"], "--masked"),
    ("a port past 65535", ["serve", "--port", "70000"], "--port"),
    ("no queue", ["serve", "--max-queue", "0"], "--max-queue"),
    ("an origin without a scheme", ["serve", "--allowed-origins", "example.com"], "--allowed-origins"),
    ("a model length of 0", ["serve", "--max-model-len", "0"], "--max-model-len"),
    ("a model length past max_seq_len", ["serve", "--max-model-len", "100", "--max-seq-len", "50"],
     "more than --max-seq-len"),
    ("zero bench runs", ["bench", "--runs", "0"], "--runs"),
    ("an unknown command", ["frobnicate"], "frobnicate"),
    ("a flag generate does not have", GEN + ["--colour"],
     "unrecognized arguments: --colour (see `mosaic generate --help`)"),
    ("given steps off the blocks", GEN + ["--gen-length", "12", "--block-length", "4", "--steps", "8"],
     "--steps 8 must be a positive multiple"),
    ("chat with zero steps", ["chat", "--steps", "0"], "--steps"),
]


@pytest.mark.parametrize("what, argv, words", CLI, ids=[r[0] for r in CLI])
def test_the_cli_answers_one_error_line(capsys, what, argv, words):
    from mosaic.cli import main
    code = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    assert words in lines[0], lines[0]


# -- the server: (what is wrong, method, path, body, status, a piece of the message)
S = {"prompt": SORT, "max_tokens": 8, "steps": 8}
C = {"messages": USER, "max_tokens": 8, "steps": 8}
SERVER = [
    ("a body that is not JSON", "/v1/completions", b"{nope", 400, "not valid JSON"),
    ("a body that is a list", "/v1/completions", [1, 2], 400, "JSON object"),
    ("no prompt", "/v1/completions", {"max_tokens": 8}, 400, "missing field 'prompt'"),
    ("a numeric prompt", "/v1/completions", {"prompt": 3}, 400, "prompt"),
    ("a fractional canvas", "/v1/completions", S | {"max_tokens": 8.5}, 400, "max_tokens"),
    ("no canvas", "/v1/completions", S | {"max_tokens": 0}, 400, "max_tokens must be positive"),
    ("an empty prompt", "/v1/completions", S | {"prompt": ""}, 400, "empty"),
    ("another model", "/v1/completions", S | {"model": "gpt-4"}, 404, "not served here"),
    ("several choices", "/v1/completions", S | {"n": 2}, 400, "n=2"),
    ("logprobs", "/v1/completions", S | {"logprobs": True}, 400, "logprobs"),
    ("a logit bias", "/v1/completions", S | {"logit_bias": {"5": 1}}, 400, "logit_bias"),
    ("echo", "/v1/completions", S | {"echo": True}, 400, "echo"),
    ("a suffix", "/v1/completions", S | {"suffix": "x"}, 400, "suffix"),
    ("best of 2", "/v1/completions", S | {"best_of": 2}, 400, "best_of"),
    ("an empty stop", "/v1/completions", S | {"stop": ""}, 400, "stop"),
    ("17 stops", "/v1/completions", S | {"stop": [str(i) for i in range(17)]}, 400, "16"),
    ("steps without end", "/v1/completions", S | {"steps": 100_000_000}, 400, "at most 8"),
    ("a negative temperature", "/v1/completions", S | {"temperature": -1}, 400, "temperature"),
    ("a seed past 64 bits", "/v1/completions", S | {"seed": 2**64}, 400, "seed"),
    ("a seed as words", "/v1/completions", S | {"seed": "abc"}, 400, "seed"),
    ("min_tokens", "/v1/completions", S | {"min_tokens": 4}, 400, "min_tokens"),
    ("a repetition penalty", "/v1/completions", S | {"repetition_penalty": 1.2}, 400, "repetition_penalty"),
    ("stream options without a stream", "/v1/completions", S | {"stream_options": {"include_usage": True}}, 400,
     "stream: true"),
    ("stop ids outside the vocabulary", "/v1/completions", S | {"stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ("ids outside the vocabulary", "/v1/completions", S | {"prompt": [10**6]}, 400, "outside the vocabulary"),
    ("the mask id in a prompt", "/v1/completions", S | {"prompt": [5, 19, 6]}, 400, "mask token"),
    ("two prompts", "/v1/completions", S | {"prompt": ["a", "b"]}, 400, "one prompt per request"),
    ("past the trained length", "/v1/completions", S | {"max_tokens": 64}, 400, "maximum context length"),
    ("a mask ratio of 2", "/v1/completions", S | {"mask_ratio": 2}, 400, "mask_ratio"),
    ("another family's option", "/v1/completions", S | {"alg": "entropy"}, 400, "alg"),
    ("a block that does not divide", "/v1/completions", S | {"block_length": 3}, 400, "block"),
    ("characters the vocabulary lacks", "/v1/completions", S | {"prompt": "sort ä"}, 400, "cannot encode"),
    ("a top_p of 2 on LLaDA", "/v1/completions", S | {"top_p": 2}, 400, "top_p=2.0 must be in (0, 1]"),
    ("a negative top_p on LLaDA", "/v1/completions", S | {"top_p": -1}, 400, "top_p=-1.0 must be in (0, 1]"),
    ("a top_k of -2 on LLaDA", "/v1/completions", S | {"top_k": -2}, 400, "top_k=-2 must be at least 1"),
    ("json_object on digits", "/v1/completions", S | {"response_format": {"type": "json_object"}}, 400,
     "which no token spells; its tokens spell only"),
    ("an unknown role", "/v1/chat/completions", C | {"messages": [{"role": "wizard", "content": "1"}]}, 400,
     "allowed roles"),
    ("no messages", "/v1/chat/completions", C | {"messages": []}, 400, "messages"),
    ("an image part", "/v1/chat/completions", C | {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "text only"),
    ("a tool message", "/v1/chat/completions", C | {"messages": USER + [{"role": "tool", "content": "1"}]}, 400,
     "tool"),
    ("continue and a generation prompt", "/v1/chat/completions", C | {"continue_final_message": True,
                                                                      "add_generation_prompt": True}, 400,
     "cannot both be true"),
    ("template kwargs not an object", "/v1/chat/completions", C | {"chat_template_kwargs": "x"}, 400,
     "chat_template_kwargs"),
    ("an unknown field in a message", "/v1/chat/completions", C | {"messages": [USER[0] | {"colour": 1}]}, 400,
     "colour"),
    ("tokenize a number", "/tokenize", {"prompt": 3}, 400, "prompt"),
    ("tokenize characters the vocabulary lacks", "/tokenize", {"prompt": "sort ä"}, 400, "cannot encode"),
    ("detokenize ids outside the vocabulary", "/detokenize", {"tokens": [10**6]}, 400, "outside the vocabulary"),
    ("detokenize text", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("tokenize for another model", "/tokenize", {"prompt": "1", "model": "gpt-4"}, 404, "not served here"),
]


@pytest.fixture(scope="module")
def client(engine):
    budgeted = MosaicEngine(engine.model, {"progress": False, "memory_budget": engine.budget.fixed_bytes + 2**20})
    with TestClient(create_app(budgeted)) as c:
        yield c


@pytest.mark.parametrize("what, path, body, status, words", SERVER, ids=[r[0] for r in SERVER])
def test_the_server_answers_a_4xx_in_openais_shape(client, what, path, body, status, words):
    r = client.post(path, content=body) if isinstance(body, bytes) else client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and words in err["message"], err


def test_a_vocabulary_error_is_short(client):
    """json_object on tiny-llada's digits-only vocabulary: the message names the missing character
    and what the vocabulary spells, not the 1,700-character compiled regex."""
    r = client.post("/v1/completions", json=S | {"response_format": {"type": "json_object"}})
    assert r.status_code == 400 and len(r.json()["error"]["message"]) < 300, r.text


def test_in_range_top_p_top_k_on_llada_are_accepted(client):
    """In range (what clients send by default), they are accepted: listed as ignored unless neutral."""
    for extra, listed in (({"top_p": 1}, set()), ({"top_k": -1}, set()), ({"top_p": 0.9, "top_k": 5},
                                                                            {"top_p", "top_k"})):
        r = client.post("/v1/completions", json=S | extra)
        assert r.status_code == 200 and set(r.json()["mosaic"]["ignored"]) == listed, r.text


def test_the_server_answers_unknown_paths_and_methods(client):
    assert client.get("/v1/models/gpt-4").status_code == 404
    assert client.get("/nowhere").status_code == 404 and "error" in client.get("/nowhere").json()
    assert client.get("/v1/completions").status_code == 405


# -- python -m bench: (what is wrong, argv, a piece of the one error line)
BENCH = [
    ("no suite", [], "name a suite"),
    ("an unknown suite", ["nosuch"], "unknown suite"),
    ("a negative prompt count", ["eval_tiny", "--per-shape", "-1"], "--per-shape"),
    ("a model that is not there", ["eval_tiny", "--model", "nosuch", "--per-shape", "1"], "nosuch"),
    ("a GPU-only suite on a CPU", ["everyday", "--part", "floors"], "GPU"),
    ("a part that is not one", ["everyday", "--part", "nosuch"], "--part"),
]


@pytest.mark.parametrize("what, argv, words", BENCH, ids=[r[0] for r in BENCH])
def test_bench_answers_one_error_line(capsys, tmp_path, what, argv, words):
    if torch.cuda.is_available() and "GPU" in words:
        pytest.skip("a GPU is here")
    from bench.__main__ import main
    code = main(argv + (["--out", str(tmp_path)] if argv and argv[0] in ("eval_tiny", "everyday") else []))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and lines and lines[-1].startswith("error:") and words in lines[-1], err


def test_there_are_at_least_100_rows():
    assert len(API) + len(CLI) + len(SERVER) + len(BENCH) + 2 >= 100
