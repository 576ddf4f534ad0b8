"""tools/train_tiny.py: its vectorised data are tasks.py's, and what it saves is what the engine runs."""

import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import train_tiny as T  # noqa: E402

from mosaic import MosaicEngine  # noqa: E402
from mosaic.assets import tasks  # noqa: E402


def test_sampler_rows_are_tasks_prompts_with_their_answers():
    vocab = tasks.vocab()
    held = tasks.held_out()
    sampler = T.Sampler(vocab, "cpu", 0, add_share=0.5, add3_share=0.7, exclude=held)
    ids, valid, keep, is_add = sampler.rows(4000, hard_share=0.5)
    rows = T.decode_rows(vocab, ids, valid)
    held = set(held)
    for (prompt, answer), k, a in zip(rows, keep.tolist(), is_add.tolist()):
        assert answer == tasks.solve(prompt), prompt
        assert k == (prompt not in held), prompt
        m = re.fullmatch(r"([1-9]\d*)\+([1-9]\d*)=", prompt)
        if a:  # tasks.sample('add', size): one operand of size digits, the other in [10, 10**size)
            x, y = m.group(1), m.group(2)
            assert max(len(x), len(y)) in (2, 3) and min(int(x), int(y)) >= 10
        else:
            assert m is None and re.fullmatch(r"sort \d{3,8}=", prompt)
    assert not keep.all()  # some held-out prompts were drawn, and left out
    # left padding: BOS first, pads before it are not valid keys
    n = valid[:, :T.PROMPT].sum(1)
    assert torch.equal(ids[torch.arange(len(ids)), T.PROMPT - n], torch.full_like(n, vocab["<|bos|>"]))


def test_short_run_saves_a_checkpoint_the_engine_runs(tmp_path):
    for arch in ("llada", "dream"):
        args = T.parser().parse_args(["--out", str(tmp_path), "--device", "cpu", "--steps", "3",
                                      "--batch", "16", "--d", "32", "--layers", "2", "--heads", "4",
                                      "--ffn", "48", "--log-every", "1"])
        res = T.train(args, arch, tmp_path / arch)
        assert res["gap"] < 1e-4   # the training forward is the engine's forward
        out = MosaicEngine(str(tmp_path / arch), {"device": "cpu", "progress": False}).generate(
            ["57+384=", "sort 907="])
        assert out.tokens.shape == (2, tasks.ANSWER_LEN)
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json", "training.json"} <= {p.name for p in (tmp_path / arch).iterdir()}
