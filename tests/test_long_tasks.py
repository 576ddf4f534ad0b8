"""The long-context tasks (mosaic/assets/long_tasks.py): deterministic, right answers, exact
lengths, held-out sets apart from training batches."""

import random
import sys
from pathlib import Path

import pytest

from mosaic.assets import long_tasks as T

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("task", T.TASKS)
@pytest.mark.parametrize("length", [64, 300, 4096])
def test_answers_and_lengths(task, length):
    rng = random.Random(1)
    for _ in range(20):
        ex = T.sample(rng, task, length)
        assert len(ex.prompt) == length - 1
        assert set(ex.prompt) <= set(T.CHARS)
        assert T.solve(ex.prompt) == ex.answer
        assert 0 < len(ex.answer) <= T.ANSWER_LEN
        assert 0.0 <= ex.depth <= 1.0
        assert T.score(ex.answer, ex.answer)["exact"] == 1.0


def test_answer_is_unambiguous():
    rng = random.Random(2)
    for _ in range(10):
        kv = T.sample(rng, "kv", 2048)
        key = kv.prompt[-T.KEY_LEN - 1:-1]
        assert kv.prompt.count(key + "=") == 2          # the record and the query
        ni = T.sample(rng, "niah", 2048)
        assert ni.prompt.count("=") == min(T.NEEDLES, 2047 // 36) + 1
        cp = T.sample(rng, "copy", 2048)
        assert cp.prompt.count(T.MARK) == 2             # the marker and the query
        assert len(cp.answer) == T.SPAN_LEN


def test_deterministic():
    a = [T.sample(random.Random(7), t, 1000) for t in T.TASKS]
    b = [T.sample(random.Random(7), t, 1000) for t in T.TASKS]
    assert a == b
    assert T.held_out("kv", 1024, 10) == T.held_out("kv", 1024, 10)
    assert T.held_out("kv", 1024, 10) != T.held_out("kv", 1024, 10, seed=1)


def test_held_out_depths_spread():
    for task in T.TASKS:
        depths = [e.depth for e in T.held_out(task, 4096, 20)]
        assert min(depths) < 0.1 and max(depths) > 0.9
        assert all(abs(d - (i + 0.5) / 20) < 0.05 for i, d in enumerate(depths))


def test_score():
    assert T.score("1234", "1234") == {"exact": 1.0, "chars": 1.0}
    assert T.score("1234", "1284") == {"exact": 0.0, "chars": 0.75}
    assert T.score("1234", "12345")["exact"] == 0.0       # must stop at end-of-text
    assert T.score("1234", "")["chars"] == 0.0


def test_training_batches_skip_held_out(monkeypatch):
    """The trainer's batches come from other seeds and skip any held-out prompt."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import train_long
    finally:
        sys.path.pop(0)
    length = T.LENGTHS[0]
    held = {e.prompt for t in T.TASKS for e in T.held_out(t, length, 10)}
    digests = {T.digest(p) for p in held}
    monkeypatch.setattr(train_long, "EXCLUDE", digests)
    ids, kinds = train_long.make_batch(0, length, 6, T.TASKS, (1.0, 1.0, 1.0))
    assert ids.shape == (6, length + T.ANSWER_LEN)
    inv = {i: c for c, i in T.vocab().items()}
    for row in ids:
        assert inv[int(row[0])] == "<|bos|>"
        prompt = "".join(inv[int(i)] for i in row[1:length])
        assert prompt not in held
        answer = "".join(inv[int(i)] for i in row[length:] if inv[int(i)] != "<|eos|>")
        assert T.solve(prompt) == answer
    # a held-out prompt that the trainer's generator happens to draw is refused
    first = T.held_out("kv", length, 10)[0]
    real = T.sample
    drawn = iter([first])
    monkeypatch.setattr(T, "sample", lambda rng, task, L, depth=None: next(drawn, None) or real(rng, task, L))
    ids, _ = train_long.make_batch(0, length, 2, ("kv",), (1.0,))
    rows = {"".join(inv[int(i)] for i in row[1:length]) for row in ids}
    assert next(drawn, None) is None and first.prompt not in rows and len(rows) == 2


def test_vocab_fits_a_char_tokenizer():
    voc = T.vocab()
    assert 40 <= len(voc) <= 64
    assert len(set(voc.values())) == len(voc)
    assert all(len(c) == 1 for c in T.CHARS) and len(set(T.CHARS)) == len(T.CHARS)


def test_trainer_model_matches_engine(tmp_path):
    """tools/train_long.py's model, saved in LLaDA's layout, computes what the engine computes."""
    import argparse

    import torch

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import train_long
    finally:
        sys.path.pop(0)
    from mosaic import load
    from mosaic.runtime.runner import NativeRunner

    torch.manual_seed(0)
    args = argparse.Namespace(d=32, layers=2, heads=2, ffn=48, rope_theta=5e5)
    model = train_long.LongLLaDA(len(T.vocab()), args.d, args.layers, args.heads, args.ffn, args.rope_theta)
    with torch.no_grad():  # bf16-exact weights, so that the saved copy is the same model
        for p in model.parameters():
            p.copy_((p + 0.05 * torch.randn_like(p)).to(torch.bfloat16).float())
    train_long.save(model, tmp_path, args, {})
    engine_model = load(tmp_path, "cpu", "float32")
    ids = torch.randint(0, len(T.CHARS), (2, 70))
    with torch.no_grad():
        ours = model(ids, 60)
        theirs = NativeRunner(engine_model).forward(ids, None)[:, 60:]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    voc = T.vocab()
    assert engine_model.tokenizer.encode("ab=1;#") == [voc["<|bos|>"]] + [voc[c] for c in "ab=1;#"]
