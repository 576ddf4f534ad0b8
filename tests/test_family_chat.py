"""iLLaDA and LLaDA2.x checkpoints with their tokenizer files laid out as the hub ships them
(tokenizer.json, tokenizer_config.json holding chat_template and the special tokens): the chat
template wraps a prompt, and the CLI generates with it."""

import json

import pytest
from plain_families import TINY_ILLADA, TINY_LLADA2, illada_keys, llada2_keys, random_state
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from mosaic import MosaicEngine, load
from mosaic.cli import main

# templates in the style of each family's published chat format (tiny vocabularies, same layout)
TEMPLATES = {
    "illada": ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ m['content'] }}<|eot_id|>"
               "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"),
    "llada2": ("{% for m in messages %}<role>{{ 'HUMAN' if m['role'] == 'user' else m['role'] | upper }}</role>"
               "{{ m['content'] }}<|role_end|>{% endfor %}{% if add_generation_prompt %}<role>ASSISTANT</role>"
               "{% endif %}"),
}
SEED = 4
SPECIAL = {"illada": {0: "<|pad|>", 1: "<|begin_of_text|>", 2: "<|end_of_text|>", 5: "<[MASK]>",
                      3: "<|start_header_id|>", 4: "<|end_header_id|>", 6: "<|eot_id|>"},
           "llada2": {45: "<|endoftext|>", 47: "<|mask|>", 44: "<|role_end|>", 43: "<role>", 42: "</role>"}}


def tokenizer_files(folder, family, vocab):
    special = SPECIAL[family]
    words = ["user", "assistant", "HUMAN", "ASSISTANT", "hi", "sort", "1", "2", "3", "4", "5", "6", "7", "8", "9"]
    ids, free = {}, iter(i for i in range(vocab) if i not in special)
    for w in words:
        ids[w] = next(free)
    for i in range(vocab):
        if i not in ids.values() and i not in special:
            ids[f"w{i}"] = i
    ids |= {t: i for i, t in special.items()}
    tok = Tokenizer(models.WordLevel(ids, unk_token=special[min(special)]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(special.values()))
    tok.save(str(folder / "tokenizer.json"))
    eos = {"illada": "<|end_of_text|>", "llada2": "<|endoftext|>"}[family]
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATES[family], "eos_token": eos, "pad_token": special[min(special)],
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192}))


@pytest.fixture(params=["illada", "llada2"])
def folder(request, tmp_path):
    fam = request.param
    raw, keys = (TINY_ILLADA, illada_keys) if fam == "illada" else (TINY_LLADA2, llada2_keys)
    sd = random_state(keys(raw), SEED)
    if fam == "illada":   # tied head: a random mask embedding makes the mask id itself the likeliest token
        sd["model.embed_tokens.weight"][5] *= 0.01
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    tokenizer_files(tmp_path, fam, raw["vocab_size"])
    return fam, tmp_path


def test_chat_template_wraps_the_prompt(folder):
    fam, path = folder
    model = load(path, device="cpu", dtype="float32")
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": "sort 3 1 2"}])
    assert text == {"illada": "<|start_header_id|>user<|end_header_id|>sort 3 1 2<|eot_id|>"
                              "<|start_header_id|>assistant<|end_header_id|>",
                    "llada2": "<role>HUMAN</role>sort 3 1 2<|role_end|><role>ASSISTANT</role>"}[fam]
    engine = MosaicEngine(model, {"progress": False})
    out = engine.generate("sort 3 1 2", chat=True, max_new_tokens=8, steps=8, block_length=4)
    assert out.tokens.shape == (1, 8) and isinstance(out.text, str)


def test_cli_generates_with_the_chat_template(folder, capsys):
    _, path = folder
    rc = main(["generate", "--model", str(path), "--chat", "--prompt", "hi", "--gen-length", "8", "--steps", "4",
               "--block-length", "4", "--dtype", "float32", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    res = json.loads(out)
    assert res["path"] == "planned" and len(res["tokens"][0]) == 8


def test_server_chat_completion(folder):
    """The OpenAI-compatible server (127.0.0.1) answers a chat request through the chat template,
    streamed and not; the answer equals the engine's own for the same prompt."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from mosaic.serve.server import ServerThread
    fam, path = folder
    engine = MosaicEngine(load(path, device="cpu", dtype="float32"), {"progress": False})
    messages = [{"role": "user", "content": "sort 3 1 2"}]
    body = {"messages": messages, "max_tokens": 8, "steps": 4, "block_length": 4}
    want = engine.generate([messages], chat=True, max_new_tokens=8, steps=4, block_length=4).text
    with ServerThread(engine, timeout=60) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want
        with c.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as s:
            assert s.status_code == 200 and "data:" in s.read().decode()
