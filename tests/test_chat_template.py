"""Chat templates render in transformers' environment (its _compile_jinja_template: loop controls,
{% generation %}, strftime_now, raise_exception, the special tokens by name, tojson without HTML
escaping), so valid checkpoint templates are not refused (they were: exit 2 in the CLI, 400 for
every chat request in the server); continue_final_message and add_generation_prompt work as in
transformers and vLLM (they were accepted and ignored: a partial assistant turn was closed and
answered as a new turn)."""

import json
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from conftest import bundled

from mosaic import MosaicEngine
from mosaic.chat_template import ChatOptions
from mosaic.errors import InputError
from mosaic.tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parents[1]
# what transformers' environment has and plain Jinja (Mosaic's before) refused or rendered otherwise
RICH = ("{%- for m in messages -%}"
        "{%- if loop.index > 3 %}{% break %}{% endif -%}"
        "{%- if m.role == 'system' %}{% continue %}{% endif -%}"
        "{% generation %}[{{ m.content }}]{% endgeneration %}"
        "{%- endfor -%}"
        "{{ mask_token }}{{ {'a': '<b>&é'} | tojson }}{{ strftime_now('%Y') }}"
        "{%- if messages | length > 4 %}{{ raise_exception('at most 4 messages') }}{% endif %}")
# a template in tiny-llada's vocabulary: turns end with <|eot|>, an assistant turn opens with '='
TURNS = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}={% endif %}{{ m.content }}<|eot|>"
         "{% endfor %}{% if add_generation_prompt %}={% endif %}")
CHAT = [{"role": "user", "content": "sort 321"}, {"role": "assistant", "content": "12"}]
# RICH's controls in tiny-llada's vocabulary (for a whole run through the CLI)
RICH_VOCAB = ("{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
              "{% if m.role == 'system' %}{% continue %}{% endif %}{% generation %}{{ m.content }}{% endgeneration %}"
              "{% endfor %}{{ strftime_now('') }}=")


def tokenizer(template: str) -> TextTokenizer:
    t = MosaicEngine(str(bundled("tiny-llada")), {"device": "cpu", "progress": False}).model.tokenizer
    return TextTokenizer(t.tok, t.settings, template)


def test_templates_render_in_transformers_environment():
    t = tokenizer(RICH)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "1"},
            {"role": "assistant", "content": "2"}, {"role": "user", "content": "3"}]
    year = datetime.now().strftime("%Y")
    assert t.apply_chat_template(msgs) == '[1][2]<|mask|>{"a": "<b>&é"}' + year
    with pytest.raises(InputError, match="the chat template refused the messages: at most 4 messages"):
        t.apply_chat_template(msgs + [{"role": "user", "content": "4"}])


def test_continue_final_message_and_add_generation_prompt():
    t = tokenizer(TURNS)
    assert t.apply_chat_template(CHAT[:1]) == "<|bos|>sort 321<|eot|>="
    assert t.apply_chat_template(CHAT, ChatOptions(add_generation_prompt=False)) == "<|bos|>sort 321<|eot|>=12<|eot|>"
    assert t.apply_chat_template(CHAT, ChatOptions(continue_final_message=True)) == "<|bos|>sort 321<|eot|>=12"
    with pytest.raises(InputError, match="cannot both be true"):
        ChatOptions(add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(InputError, match="does not appear in the chat template's output"):
        tokenizer("{{ bos_token }}{% for m in messages %}({{ m.role }}){% endfor %}").apply_chat_template(
            CHAT, ChatOptions(continue_final_message=True))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """tiny-llada with the TURNS template in chat_template.jinja, and one with RICH_VOCAB."""
    out = {}
    for name, template in (("turns", TURNS), ("rich", RICH_VOCAB)):
        f = tmp_path_factory.mktemp(name)
        for p in bundled("tiny-llada").iterdir():
            shutil.copy(p, f / p.name)
        (f / "chat_template.jinja").write_text(template)
        out[name] = f
    return out


def test_generate_continues_a_partial_assistant_turn(folder):
    engine = MosaicEngine(str(folder["turns"]), {"device": "cpu", "progress": False})
    ids = engine.encode(CHAT, template=ChatOptions(continue_final_message=True))[0]
    assert engine.model.tokenizer.decode(ids, skip_special_tokens=False) == "<|bos|>sort 321<|eot|>=12"
    out = engine.generate(CHAT, continue_final_message=True, max_new_tokens=4, steps=4)
    closed = engine.generate(CHAT, add_generation_prompt=False, max_new_tokens=4, steps=4)
    assert out.sequences[0, :len(ids)].tolist() == ids and closed.sequences.shape[1] == len(ids) + 1 + 4


def test_the_cli_renders_rich_templates_and_continues_messages(folder, tmp_path):
    msgs = tmp_path / "chat.json"
    msgs.write_text(json.dumps(CHAT))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "mosaic", "generate", "--device", "cpu", "--max-new-tokens", "4",
                               "--steps", "4", "--no-progress", *args], capture_output=True, text=True, cwd=ROOT,
                              timeout=300)
    ok = cli("--model", str(folder["turns"]), "--messages", str(msgs), "--continue-final-message", "--json")
    assert ok.returncode == 0, ok.stderr
    rich = cli("--model", str(folder["rich"]), "--chat", "--prompt", "sort 321")
    assert rich.returncode == 0 and rich.stdout.strip() == "sort 321123", (rich.stdout, rich.stderr)
    both = cli("--model", str(folder["turns"]), "--messages", str(msgs), "--continue-final-message", "--chat",
               "--prompt", "x")
    assert both.returncode == 2 and both.stderr.startswith("error:") and "one kind per run" in both.stderr


def test_the_server_takes_vllms_chat_fields(folder):
    from fastapi.testclient import TestClient

    from mosaic.serve.app import create_app
    engine = MosaicEngine(str(folder["turns"]), {"device": "cpu", "progress": False})
    body = {"messages": CHAT, "max_tokens": 4, "steps": 4, "return_token_ids": True}
    with TestClient(create_app(engine)) as c:
        cont = c.post("/v1/chat/completions", json=body | {"continue_final_message": True,
                                                            "add_generation_prompt": False}).json()
        shown = lambda ids: engine.model.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        assert shown(cont["mosaic"]["prompt_token_ids"]).endswith("<|eot|>=12")
        assert cont["mosaic"]["ignored"] == {}
        new_turn = c.post("/v1/chat/completions", json=body).json()
        assert shown(new_turn["mosaic"]["prompt_token_ids"]).endswith("=12<|eot|>=")
        r = c.post("/v1/chat/completions", json=body | {"continue_final_message": True, "add_generation_prompt": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_the_bundled_template_joins_the_turns_as_the_readme_says():
    """README: tiny-llada's chat template joins the messages' texts, so a second turn is one longer
    prompt (answered wrong: it was trained on one task per prompt)."""
    bundled("tiny-llada")
    eng = MosaicEngine("tiny-llada", {"device": "cpu", "progress": False})
    turns = [{"role": "user", "content": "57+384="}, {"role": "assistant", "content": "441"},
             {"role": "user", "content": "sort 31415926="}]
    assert eng.encode(turns, chat=True) == eng.encode("57+384=441sort 31415926=", chat=True)
