"""Every bad input a new user met, and the others of their kinds, through the CLI (mosaic.cli.main, in
process) and the API: a refusal is exit code 2 with exactly one `error:` line and no traceback
(MosaicError from the API), anything accepted gives the right result."""

import io
import json
import shutil
import warnings

import pytest
import torch
from conftest import BUNDLED, TINY, random_model

from mosaic import CheckpointError, InputError, MemoryBudgetError, MosaicEngine, load
from mosaic import loader as loader_mod
from mosaic.checkpoint_fields import ConfigFieldWarning
from mosaic.cli import build_parser, main
from mosaic.engine import LengthWarning
from mosaic.loader import save
from mosaic.models.families import FAMILIES
from mosaic.runtime.samplers.dream import draw_positions

GEN = ["generate", "--no-progress"]


@pytest.fixture
def ckpt(tmp_path):
    """make(family, config changes (... deletes a field), extra files, tokenizer?) -> folder."""
    count = [0]

    def make(fam="llada", changes=None, files=None, tokenizer=False, seed=0):
        count[0] += 1
        folder = save(random_model(fam, seed), tmp_path / f"{fam}-{count[0]}")
        raw = json.loads((folder / "config.json").read_text())
        for k, v in (changes or {}).items():
            raw.pop(k) if v is ... else raw.__setitem__(k, v)
        (folder / "config.json").write_text(json.dumps(raw))
        if tokenizer:  # the bundled character tokenizer: its 21 ids fit every tiny vocabulary
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(BUNDLED["tiny-llada"] / name, folder / name)
        for name, text in (files or {}).items():
            (folder / name).write_text(text)
        return folder
    return make


def cli(capsys, argv, code=2):
    """Run the CLI in process: (stdout, stderr); a refusal has exactly one `error:` line."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert rc == code, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    if code == 2:
        assert sum(line.startswith("error:") for line in lines) == 1, err
        assert all(line.startswith(("error:", "warning:")) for line in lines), err
    return out, err


def truncated(ckpt):
    folder = ckpt("llada")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return folder


# (argv builder given the ckpt fixture, a fragment of the one error line)
CLI_REFUSALS = [
    (lambda c: ["plan", "--model", "tiny-llada", "--tokens", 64, "--planner", "brute"], "invalid choice: 'brute'"),
    (lambda c: [*GEN, "--model", truncated(c), "--ids", "1,2"], "damaged or incomplete"),
    (lambda c: [*GEN, "--device", "foo"], "device='foo'"),
    (lambda c: [*GEN, "--model", "tiny-dream", "--prompt", "1+2=", "--alg-temp", -1], "--alg-temp must be >= 0"),
    (lambda c: [*GEN, "--memory-plot", "x.txt"], "written as .png, .svg, .pdf"),
    (lambda c: [*GEN, "--memory-plot", "no/such/folder/x.png"], "does not exist"),
    (lambda c: ["plan", "--tokens", -5], "--tokens: must be at least 1"),
    (lambda c: ["plan", "--tokens", 100, "--masked", -3], "--masked: must be at least 1"),
    (lambda c: ["plan", "--tokens", 100, "--masked", 500], "more than --tokens 100"),
    (lambda c: ["plan", "--model", "tiny-llada"], "needs --tokens N"),
    (lambda c: [*GEN, "--steps", 0], "--steps: must be at least 1"),
    (lambda c: [*GEN, "--gpus", 0], "--gpus: must be at least 1"),
    (lambda c: [*GEN, "--gpus", -1], "--gpus: must be at least 1"),
    (lambda c: [*GEN, "--gen-length", 0], "must be at least 1"),
    (lambda c: [*GEN, "--budget", 2], "has no unit"),
    (lambda c: [*GEN, "--budget", "lots"], "cannot read memory size"),
    (lambda c: [*GEN, "--budget", "100MB"], "below what tiny-llada holds"),
    (lambda c: ["plan", "--model", "llada-8b", "--budget", "8GiB", "--device", "cuda"],
     "the weights alone need 14.93 GiB"),
    (lambda c: [*GEN, "--prompt", "héllo ✓"], "cannot encode: 'h' (U+0068), 'é' (U+00E9)"),
    (lambda c: [*GEN, "--prompt", "12+<|mask|>="], "contains the mask token (id 19) at position 4"),
    (lambda c: [*GEN, "--ids", "17,1,19,2"], "contains the mask token"),
    (lambda c: [*GEN, "--ids", "1,999"], "outside the vocabulary"),
    (lambda c: [*GEN, "--ids", "1,x"], "token ids are whole numbers"),
    (lambda c: [*GEN, "--model", "GSAI-ML/LLaDA-8B-Instruct", "--prompt", "hi"], "Mosaic never downloads"),
    (lambda c: [*GEN, "--model", "no/such/folder", "--prompt", "hi"], "model folder 'no/such/folder' does not exist"),
    (lambda c: [*GEN, "--model", "./missing", "--prompt", "hi"], "model folder './missing' does not exist"),
    (lambda c: [*GEN, "--model", c("llada"), "--prompt", "hi"], "prompts must be token ids (a list of ints; "
                                                                "on the command line: --ids 1,2,3)"),
    (lambda c: [*GEN, "--model", c("llada")], "no prompt: give --prompt"),
    (lambda c: [], "choose a command"),
    (lambda c: [*GEN, "--colour", "red"], "unrecognized arguments: --colour red"),
    (lambda c: [*GEN, "--chunks", "1,x,2"], "three positive counts"),
    (lambda c: [*GEN, "--prompt-file", "no-such-file.txt"], "cannot read it"),
    (lambda c: [*GEN, "--prompt", "1+2=", "--ids", "1,2"], "one kind per run"),
    (lambda c: [*GEN, "--ids", "1,2", "--chat"], "does not apply to --ids"),
    (lambda c: [*GEN, "--temperature", "nan"], "--temperature must be a finite number"),
    (lambda c: [*GEN, "--temperature", -1], "--temperature must be >= 0"),
    (lambda c: [*GEN, "--seed", -1], "--seed must be in [0, 2**64)"),
    (lambda c: [*GEN, "--model", "tiny-dream", "--prompt", "1=", "--top-p", 2], "--top-p must be in (0, 1]"),
    (lambda c: [*GEN, "--model", "tiny-dream", "--prompt", "1=", "--eps", 1.5], "--eps"),
    (lambda c: [*GEN, "--alg", "entropy"], "alg is a Dream sampler option"),
    (lambda c: [*GEN, "--model", "tiny-dream", "--prompt", "1=", "--cfg-scale", 1], "--cfg-scale is a LLaDA"),
    (lambda c: [*GEN, "--gen-length", 8, "--block-length", 3], "not divisible by --block-length 3"),
    (lambda c: [*GEN, "--gen-length", 8, "--block-length", 4, "--steps", 3], "multiple of the number of blocks"),
    (lambda c: [*GEN, "--cfg-scale", -1], "--cfg-scale must be >= 0"),
    (lambda c: [*GEN, "--model", c("llada_moe"), "--ids", "1,2", "--confidence-eos-eot-inf"], "eot_token_id"),
    (lambda c: [*GEN, "--model", c("llada", {"eos_token_id": None, "pad_token_id": 3}), "--ids", "1,2",
                "--logits-eos-inf"], "eos_token_id"),
    (lambda c: [*GEN, "--model", c("llada_moe", {"norm_topk_prob": True}), "--ids", "1"], "norm_topk_prob=True"),
    (lambda c: [*GEN, "--model", c("dream", {"rope_scaling": {"type": "linear", "factor": 2.0}}), "--ids", "1"],
     "rope_scaling="),
    (lambda c: [*GEN, "--model", c("dream", {"use_sliding_window": True}), "--ids", "1"], "use_sliding_window"),
    (lambda c: [*GEN, "--model", c("llada", {"include_bias": True}), "--ids", "1"], "include_bias=True"),
    (lambda c: [*GEN, "--model", c("llada_moe", {"moe_layer_freq": [0, 1]}), "--ids", "1"], "moe_layer_freq"),
    (lambda c: [*GEN, "--model", c("llada", {"model_type": "gpt2"}), "--ids", "1"], "unknown model_type 'gpt2'"),
    (lambda c: [*GEN, "--model", c("llada", {"mask_token_id": ...}), "--ids", "1"], "has no mask_token_id"),
    (lambda c: [*GEN, "--model", c("llada", {"eos_token_id": 500}), "--ids", "1"],
     "eos_token_id=500 is outside the vocabulary [0, 37)"),
    (lambda c: [*GEN, "--model", c("llada", {"eos_token_id": "</s>"}), "--ids", "1"], "is not a token id"),
    (lambda c: [*GEN, "--model", c("llada", {"eos_token_id": 36}), "--ids", "1"], "also eos_token_id"),
    (lambda c: [*GEN, "--model", c("llada", {"n_heads": 5}), "--ids", "1"], "cannot run"),
    (lambda c: [*GEN, "--model", c("llada", {"d_model": "wide"}), "--ids", "1"], "d_model='wide' is not a int"),
    (lambda c: [*GEN, "--model", c("llada", files={"config.json": "{oops"}), "--ids", "1"], "is not valid JSON"),
    (lambda c: [*GEN, "--model", c("llada", files={"generation_config.json": "[1"}), "--ids", "1"],
     "generation_config.json is not valid JSON"),
    (lambda c: [*GEN, "--model", c("llada", files={"generation_config.json": '{"steps": "many"}'}), "--ids", "1"],
     "--steps must be an integer"),
    (lambda c: [*GEN, "--model", c("llada", files={"tokenizer.json": "{}"}), "--ids", "1"], "cannot read"),
    (lambda c: [*GEN, "--model", c("llada", files={"model.safetensors.index.json": '{"weight_map": {"a": "b"}}'}),
                "--ids", "1"], "names shard files that are missing"),
    (lambda c: [*GEN, "--gen-length", 10**11], "of host memory"),   # was a raw RuntimeError in torch.full
    (lambda c: [*GEN, "--prompt", ""], "the prompt is empty"),
    (lambda c: [*GEN, "--prompt", "   "], "the prompt is empty"),
    (lambda c: [*GEN, "--budget", "1.5"], "memory size '1.5' has no unit"),   # was read as 1.5 bytes
]


@pytest.mark.parametrize("make_argv, message", CLI_REFUSALS, ids=[m for _, m in CLI_REFUSALS])
def test_cli_refuses_with_one_error_line(capsys, ckpt, make_argv, message):
    _, err = cli(capsys, make_argv(ckpt))
    assert message in err, err


def test_cli_triton_and_vmm_need_cuda(capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs both")
    monkeypatch.setenv("TRITON_INTERPRET", "0")   # the tests' CPU interpreter would accept Triton
    _, err = cli(capsys, [*GEN, "--logits-kernel", "triton"])
    assert "needs a CUDA device" in err
    _, err = cli(capsys, [*GEN, "--arena", "vmm"])
    assert "arena 'vmm') needs a CUDA device" in err
    _, err = cli(capsys, [*GEN, "--attention", "triton"])    # was run as SDPA on the CPU, labelled lossy
    assert "needs a CUDA device" in err and "attention='sdpa'" in err
    _, err = cli(capsys, [*GEN, "--attention", "cudnn"])
    assert "attention 'cudnn' needs a CUDA device" in err


def test_cli_preset_larger_than_host_memory(capsys, monkeypatch):
    """The preset is refused before its weights are allocated (here: a machine with 8 GiB free)."""
    monkeypatch.setattr(loader_mod, "available_bytes", lambda device: 8 * 2**30)
    _, err = cli(capsys, [*GEN, "--model", "llada-8b", "--ids", "1,2"])
    assert "llada-8b needs 29.86 GiB for its weights in float32 on cpu, but only 8.00 GiB" in err
    assert "--dtype bfloat16: 14.93 GiB" in err


def test_cli_plot_path_is_checked_before_loading(capsys, monkeypatch):
    monkeypatch.setattr("mosaic.cli.MosaicEngine", lambda *a, **k: pytest.fail("loaded a model"))
    cli(capsys, [*GEN, "--memory-plot", "missing-folder/step.png"])


# accepted inputs: (argv builder, a fragment of stdout, a fragment of stderr)
CLI_ACCEPTS = [
    (lambda c: [*GEN, "--prompt", "sort 4321="], "sort 4321=1234", "tokens/s"),
    (lambda c: [*GEN, "--model", BUNDLED["tiny-llada"] / "config.json", "--prompt", "sort 4321="], "=1234", ""),
    (lambda c: [*GEN, "--model", c("llada"), "--ids", "1,2,3"], "1 2 3 | ", "tokens/s"),
    (lambda c: [*GEN, "--model", c("llada", {"eos_token_id": [35, 33]}), "--ids", "1,2", "--ids", "3"], "3 | ", ""),
    (lambda c: [*GEN, "--model", c("llada", {"pad_token_id": None}), "--ids", "1,2", "--ids", "3,4,5"], "1 2 | ", ""),
    (lambda c: [*GEN, "--model", c("llada_moe", {"norm_topk_prob": False, "eot_token_id": 30}), "--ids", "1,2",
                "--confidence-eos-eot-inf"], "1 2 | ", ""),
    (lambda c: [*GEN, "--model", "tiny-dream", "--prompt", "12+30=", "--gen-length", 100],
     "12+30=", "warning: prompt (7 tokens) + --max-new-tokens (100) = 107 tokens is longer than this model's "
               "maximum length 64"),
    (lambda c: [*GEN, "--model", c("llada", {"colour": "red"}), "--ids", "1"], "1 | ",
     "warning: config.json fields Mosaic does not know are ignored: ['colour']"),
    (lambda c: ["plan", "--model", "tiny-llada", "--tokens", 64, "--masked", 64, "--planner", "best"], "best", ""),
]


@pytest.mark.parametrize("make_argv, out_part, err_part", CLI_ACCEPTS)
def test_cli_accepts(capsys, ckpt, make_argv, out_part, err_part):
    out, err = cli(capsys, make_argv(ckpt), code=0)
    assert out_part in out and err_part in err, (out, err)


def test_cli_version_and_help(capsys):
    out, _ = cli(capsys, ["--version"], code=0)
    assert out.startswith("mosaic 0.")
    parser = build_parser()
    subs = parser._subparsers._group_actions[0].choices
    for name, sub in subs.items():
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, f"mosaic {name} {action.option_strings} has no help"
        text = " ".join(sub.format_help().split())
        assert "(default: tiny-llada)" in text or "(default: llada-8b)" in text or \
            "default: tiny-long)" in text, name      # calibrate: its positional MODEL says it


def test_cli_prompt_from_stdin(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("sort 4321=\n"))
    out, _ = cli(capsys, [*GEN, "--prompt-file", "-"], code=0)
    assert out.strip() == "sort 4321=1234"


def test_cli_json_has_rate_and_tokens(capsys):
    out, _ = cli(capsys, [*GEN, "--json", "--prompt", "sort 4321="], code=0)
    rec = json.loads(out)
    assert rec["texts"] == ["1234"] and rec["tokens_per_second"] > 0 and len(rec["tokens"][0]) == 8


# ------------------------------------------------------------------ the API


def eng(fam="llada", **changes):
    return MosaicEngine(random_model(fam, **changes), {"progress": False})


API_REFUSALS = [
    (lambda e: e.generate([1, 2], inputs=[3, 4], max_new_tokens=4), "pass the prompt once"),
    (lambda e: e.generate(max_new_tokens=4), "needs a prompt"),
    (lambda e: e.generate(torch.tensor([[1.0, 2.0]]), max_new_tokens=4), "integer token ids"),
    (lambda e: e.generate([1, True], max_new_tokens=4), "list of token ids"),
    (lambda e: e.generate([[1, 2], [3.5]], max_new_tokens=4), "list of token ids"),
    (lambda e: e.generate([1, 36, 2], max_new_tokens=4), "contains the mask token (id 36) at position 1"),
    (lambda e: e.generate(inputs=torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[1, 1, 0]]),
                          max_new_tokens=4), "left only"),
    (lambda e: e.generate(inputs=torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[1, 1]]),
                          max_new_tokens=4), "must match"),
    (lambda e: e.generate(inputs=torch.tensor([[1, 2]]), attention_mask=torch.tensor([[0, 0]]),
                          max_new_tokens=4), "all zeros"),
    (lambda e: e.generate(inputs=torch.tensor([[1, 2]]), attention_mask=torch.tensor([[2, 1]]),
                          max_new_tokens=4), "only 0 (padding) and 1"),
    (lambda e: e.generate([1, 2], max_new_tokens=4, steps=2.5), "steps must be an integer"),
    (lambda e: e.generate([1, 2], max_new_tokens=True), "max_new_tokens must be an integer"),
    (lambda e: e.generate([1, 2], max_new_tokens=4, logits_eos_inf="yes"), "logits_eos_inf must be true or false"),
    (lambda e: e.generate([1, 2], max_new_tokens=4, seed=2**64), "seed must be in"),
    (lambda e: e.generate([1, 2], max_new_tokens=10**11), "of host memory"),
    (lambda e: e.generate("", max_new_tokens=4), "the prompt is empty"),
    (lambda e: MosaicEngine(e.model, {"memory_budget": "2"}), "has no unit"),
    (lambda e: MosaicEngine(e.model, {"arena": "vmm"}) if not torch.cuda.is_available() else
     pytest.skip("CUDA here"), "needs a CUDA device"),
]


@pytest.mark.parametrize("call, message", API_REFUSALS, ids=[m for _, m in API_REFUSALS])
def test_api_refuses(call, message):
    with pytest.raises(InputError, match=pytest.importorskip("re").escape(message)):
        call(eng())


def test_inputs_and_attention_mask_give_the_list_result():
    e = eng("dream")
    ids = torch.tensor([[39, 39, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    a = e.generate(inputs=ids, attention_mask=mask, max_new_tokens=6, steps=3, alg="entropy")
    b = e.generate([[5, 6, 7], [1, 2, 3, 4, 5]], max_new_tokens=6, steps=3, alg="entropy")
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(e.generate(inputs=[5, 6, 7], max_new_tokens=6, steps=3, alg="entropy").tokens[0], a.tokens[0])


@pytest.mark.parametrize("fam, kw", [("llada", dict(temperature=0.7, remasking="random")),
                                     ("dream", dict(temperature=0.7, alg="origin"))])
def test_unseeded_runs_draw_from_torchs_generator(fam, kw):
    e = eng(fam)
    torch.manual_seed(123)
    a = e.generate([1, 2, 3], max_new_tokens=8, steps=4, **kw).tokens
    assert torch.initial_seed() == 123           # the global state is drawn from, never re-seeded
    torch.manual_seed(123)
    b = e.generate([1, 2, 3], max_new_tokens=8, steps=4, **kw).tokens
    torch.manual_seed(124)
    c = e.generate([1, 2, 3], max_new_tokens=8, steps=4, **kw).tokens
    assert torch.equal(a, b) and not torch.equal(a, c)
    state = torch.get_rng_state()
    d = e.generate([1, 2, 3], max_new_tokens=8, steps=4, seed=5, **kw).tokens   # a private generator
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(d, e.generate([1, 2, 3], max_new_tokens=8, steps=4, seed=5, **kw).tokens)


def test_dream_alg_temp_never_leaves_positions_masked():
    """The issue's case: 4 steps, 'entropy', a small alg_temp. Every step decodes its share of
    masked positions; prompt tokens are never overwritten."""
    e = eng("dream")
    prompt = [1, 2, 3, 4, 5, 6]
    for native in (True, False):
        out = e.generate(prompt, max_new_tokens=16, steps=4, alg="entropy", alg_temp=1e-4, native=native)
        assert out.sequences[0, :6].tolist() == prompt
        steps = []
        e.generate(prompt, max_new_tokens=16, steps=4, alg="entropy", alg_temp=1e-4, native=native,
                   on_step=lambda i, x: steps.append(int((x[0, 6:] == 40).sum())))
        assert steps[-1] == 0 or steps[-1] == int((out.tokens == 40).sum())   # only predicted mask ids remain
        assert steps == sorted(steps, reverse=True) and steps[-1] < 16


def test_draw_positions_fills_the_shortfall_by_confidence():
    conf = torch.tensor([[0.0, -50.0, -60.0, -torch.inf, -70.0, -torch.inf]])
    got = draw_positions(conf, 0.1, 3, None)          # only position 0 has non-zero weight
    assert got[0, 0] == 0 and sorted(got[0].tolist()) == [0, 1, 2]
    ok = torch.tensor([[0.0, -0.1, -0.2, -torch.inf]])
    torch.manual_seed(0)
    a = draw_positions(ok, 1.0, 2, None)
    torch.manual_seed(0)
    assert torch.equal(a, torch.multinomial(torch.softmax(ok, -1), 2))  # the reference's draw


def test_length_warning_once():
    e = eng("llada", max_seq_len=16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        e.generate([1, 2, 3, 4], max_new_tokens=16, steps=4)
        e.generate([1, 2, 3, 4], max_new_tokens=16, steps=4)
    assert [type(w.message) for w in seen] == [LengthWarning]
    assert "20 tokens is longer than this model's maximum length 16" in str(seen[0].message)


# ------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("fam, field", [(f, n) for f, rec in FAMILIES.items() if f in TINY for n in rec.refused])
def test_every_refused_field_is_named(ckpt, fam, field):
    folder = ckpt(fam, {field: "__other__"})
    with pytest.raises(CheckpointError, match=field):
        load(folder, device="cpu")


def test_published_values_of_those_fields_load(ckpt):
    for fam, extra in [
        ("llada", {"activation_type": "silu", "block_type": "llama", "layer_norm_type": "rms", "alibi": False,
                   "include_bias": False, "rope": True, "scale_logits": False, "clip_qkv": None,
                   "attention_layer_norm": False, "layer_norm_with_affine": True}),
        ("dream", {"hidden_act": "silu", "rope_scaling": None, "use_sliding_window": False, "sliding_window": None}),
        ("llada_moe", {"hidden_act": "silu", "norm_topk_prob": False, "moe_router_score_function": "softmax",
                       "routed_scaling_factor": 1, "moe_router_enable_expert_bias": False, "clip_qkv": None,
                       "attention_bias": False, "moe_layer_freq": [1, 1], "router_num_group": None})]:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConfigFieldWarning)    # every published field is known
            load(ckpt(fam, extra), device="cpu")


def test_special_ids(ckpt):
    m = load(ckpt("llada", {"eos_token_id": [35, 33]}), device="cpu")
    assert m.cfg.eos_id == 35 and m.cfg.extra_eos_ids == (33,)
    m = load(ckpt("llada", {"pad_token_id": None, "eos_token_id": None, "bos_token_id": None}), device="cpu")
    assert m.cfg.pad_id is None and m.cfg.eos_id is None        # the LLaDA defaults lie outside 37 ids
    e = MosaicEngine(m, {"progress": False})
    out = e.generate([[1, 2], [3, 4, 5]], max_new_tokens=4, steps=4)   # padding needs no pad id
    assert out.tokens.shape == (2, 4) and e.pad_filler() == 0
    m = load(ckpt("llada_moe", {"pad_token_id": 42}), device="cpu")   # pad == mask: never padded with it
    assert m.cfg.pad_id is None and MosaicEngine(m).pad_filler() != m.cfg.mask_id


def test_moe_without_qk_norm_loads_as_published(ckpt, saved):
    model = random_model("llada_moe", qk_norm=False)
    folder = save(model, ckpt("llada_moe").parent / "noqk")
    assert json.loads((folder / "config.json").read_text())["qk_layernorm"] is False
    back = load(folder, device="cpu")
    assert not back.cfg.qk_norm and "q_norm" not in back.layers[0]


def test_hub_id_and_config_path():
    with pytest.raises(CheckpointError, match="hf download GSAI-ML/LLaDA-8B-Instruct --local-dir"):
        load("GSAI-ML/LLaDA-8B-Instruct")
    assert load(BUNDLED["tiny-llada"] / "config.json").cfg.vocab == 21


def test_folder_layouts_old_and_new(ckpt):
    """Chat templates in tokenizer_config.json (a string or named list), chat_template.jinja,
    chat_template.json; special tokens in special_tokens_map.json."""
    jinja = "{{ bos_token }}<{% for m in messages %}{{ m['content'] }}{% endfor %}>"
    cases = [
        {"chat_template.jinja": jinja},
        {"chat_template.json": json.dumps({"chat_template": jinja})},
        {"tokenizer_config.json": json.dumps({"chat_template": [{"name": "tool_use", "template": "x"},
                                                                {"name": "default", "template": jinja}],
                                              "bos_token": "<|bos|>"})},
        {"tokenizer_config.json": json.dumps({"chat_template": jinja}),
         "special_tokens_map.json": json.dumps({"bos_token": {"content": "<|bos|>"}})},
    ]
    for files in cases:
        m = load(ckpt("llada", files=files, tokenizer=True), device="cpu")
        assert m.tokenizer.apply_chat_template([{"role": "user", "content": "1+2"}]) == "<|bos|><1+2>"


def test_tokenizer_names_unknown_characters():
    m = load("tiny-llada")
    with pytest.raises(InputError, match=r"'é' \(U\+00E9\), '✓' \(U\+2713\); they would be read as '<\|eos\|>'"):
        m.tokenizer.encode("12é✓")
    assert m.tokenizer.encode("12") == [17, 1, 2]


def test_weights_larger_than_memory_are_refused_before_allocating(ckpt, monkeypatch):
    monkeypatch.setattr(loader_mod, "available_bytes", lambda device: 1000)
    monkeypatch.setattr(loader_mod, "allocate", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(MemoryBudgetError, match="needs .* for its weights"):
        load(ckpt("dream"), device="cpu")
    with pytest.raises(MemoryBudgetError, match="dream-7b needs"):
        load("dream-7b", device="cpu")


def test_generation_config_fields_of_the_other_family_are_left_out(ckpt):
    folder = ckpt("llada", files={"generation_config.json": '{"top_p": 0.9, "steps": 2, "max_new_tokens": 4, '
                                                            '"eos_token_id": [35], "do_sample": true}'})
    e = MosaicEngine(folder, {"progress": False})
    with pytest.warns(UserWarning, match=r"sets \['top_p'\], which the LLaDA sampler does not read"):
        out = e.generate([1, 2, 3])
    assert out.steps == 2 and out.tokens.shape == (1, 4)


def test_unseeded_random_sampling_across_processes_is_refused(monkeypatch):
    import mosaic.engine.request as engine_mod
    e = eng("llada")   # built alone: with several processes the engine measures NCCL's context
    monkeypatch.setattr(engine_mod, "world", lambda: (0, 2))
    with pytest.raises(InputError, match="across several processes pass seed=N"):
        e.check([[1, 2]], e.generation_config(max_new_tokens=4, temperature=0.5))
    e.check([[1, 2]], e.generation_config(max_new_tokens=4))              # greedy: no draws to agree on
    e.check([[1, 2]], e.generation_config(max_new_tokens=4, temperature=0.5, seed=1))


@pytest.mark.parametrize("options, param", [
    ({"steps": 0}, "steps"), ({"temperature": -1.0}, "temperature"), ({"speculate": -1}, "speculate"),
    ({"block_length": "4"}, "block_length"), ({"cache": "x"}, "cache"), ({"threshold": 2.0}, "threshold"),
    ({"factor": 0.0}, "factor"),
])
def test_an_option_error_carries_the_option_it_is_about(options, param):
    from mosaic.config import OPTIONS, GenerationConfig
    with pytest.raises(InputError) as e:
        gen = GenerationConfig(**options)
        for name in options:
            OPTIONS[name].check(name, getattr(gen, name))
    assert e.value.param == param and param in str(e.value)
    assert InputError("no option").param is None
