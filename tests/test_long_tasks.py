"""The long-context tasks (mosaic/assets/long_tasks.py) and tools/train_long.py's data and loss:
deterministic, right answers, exact lengths, held-out sets apart from training batches, the
loss masking only the answer tokens (never the prompt), and the trainer's model equal to the
engine's."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mosaic.assets import long_tasks as T

ROOT = Path(__file__).resolve().parents[1]


def _train_long():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import train_long
    finally:
        sys.path.pop(0)
    return train_long


@pytest.mark.parametrize("task", T.TASKS)
@pytest.mark.parametrize("length", [16, 64, 300, 4096])
def test_answers_and_lengths(task, length):
    rng = np.random.default_rng(1)
    for _ in range(20):
        ex = T.sample(rng, task, length)
        assert len(ex.ids) == length - 1
        assert len(ex.prompt.split(" ")) == length - 1
        assert np.array_equal(T.encode(ex.prompt), ex.ids)
        assert T.solve(ex.prompt) == ex.answer
        assert 0 < len(ex.answer.split()) <= T.ANSWER_LEN
        assert np.array_equal(T.answer_ids(ex.answer), ex.answer_ids)
        assert 0.0 <= ex.depth <= 1.0
        assert len(ex.supervised) == 0
        assert T.score(ex.answer, ex.answer)["exact"] == 1.0


@pytest.mark.parametrize("task", ["kv", "niah"])
@pytest.mark.parametrize("length", [16, 40, 256, 2048])
def test_answered_queries(task, length):
    """Training rows with several queries: each earlier query is answered right, its value
    tokens are the supervised positions, and the asked key still occurs once before the query."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        ex = T.sample(rng, task, length, queries=8)
        assert len(ex.ids) == length - 1 and T.solve(ex.prompt) == ex.answer
        words = ex.prompt.split(" ")
        asks = [i for i, w in enumerate(words) if w == "?"]
        assert len(ex.supervised) == T.VALUE_LEN * (len(asks) - 1)
        if length >= 256:
            assert len(asks) == 8 if task == "kv" else len(asks) > 1
        for a in asks[:-1]:
            key = words[a + 1]
            head = words[:asks[0]]
            assert head.count(key) == 1
            at = head.index(key) + 1
            assert words[a + 2:a + 2 + T.VALUE_LEN] == head[at:at + T.VALUE_LEN]
            assert [a + 2 + j for j in range(T.VALUE_LEN)] == [int(s) for s in ex.supervised
                                                               if a < s < a + 2 + T.VALUE_LEN]
        keys = [words[a + 1] for a in asks]
        assert len(set(keys)) == len(keys)


def test_answer_is_unambiguous():
    rng = np.random.default_rng(2)
    for _ in range(10):
        kv = T.sample(rng, "kv", 2048)
        words = kv.prompt.split(" ")
        assert words.count(words[-1]) == 2              # the record and the query
        ni = T.sample(rng, "niah", 2048)
        w = ni.prompt.split(" ")
        assert sum(x.startswith("k") for x in w) == min(T.NEEDLES, 2045 // (4 * T.REC)) + 1
        cp = T.sample(rng, "copy", 2048)
        assert cp.prompt.split(" ").count("#") == 2     # the marker and the query
        assert len(cp.answer.split()) == T.SPAN_LEN


def test_deterministic():
    a = [T.sample(np.random.default_rng(7), t, 1000) for t in T.TASKS]
    b = [T.sample(np.random.default_rng(7), t, 1000) for t in T.TASKS]
    assert a == b
    assert T.held_out("kv", 1024, 10) == T.held_out("kv", 1024, 10)
    assert T.held_out("kv", 1024, 10) != T.held_out("kv", 1024, 10, seed=1)


def test_held_out_depths_spread():
    for task in T.TASKS:
        depths = [e.depth for e in T.held_out(task, 4096, 20)]
        assert min(depths) < 0.1 and max(depths) > 0.9
        assert all(abs(d - (i + 0.5) / 20) < 0.05 for i, d in enumerate(depths))


def test_score():
    assert T.score("v1 v2", "v1 v2") == {"exact": 1.0, "tokens": 1.0}
    assert T.score("w1 w2 w3 w4", "w1 w2 w9 w4") == {"exact": 0.0, "tokens": 0.75}
    assert T.score("v1 v2", "v1 v2 v3")["exact"] == 0.0    # must stop at end-of-text
    assert T.score("v1 v2", "")["tokens"] == 0.0


def test_training_batches_skip_held_out(monkeypatch):
    """The trainer's batches come from other seeds and skip any held-out prompt."""
    train_long = _train_long()
    length = T.LENGTHS[0]
    held = {T.digest(e.ids) for t in T.TASKS for e in T.held_out(t, length, 10)}
    monkeypatch.setattr(train_long, "EXCLUDE", held)
    ids, sup, kinds = train_long.make_batch(0, length, 6, T.TASKS, (1.0, 1.0, 1.0), queries=3)
    assert ids.shape == sup.shape == (6, length + T.ANSWER_LEN) and kinds.shape == (6,)
    for row, s in zip(ids, sup):
        assert row[0] == T.BOS
        prompt = T.text(row[1:length])
        assert T.digest(row[1:length]) not in held
        assert T.solve(prompt) == T.text(row[length:][row[length:] != T.EOS])
        assert s[length:].all() and not s[0]
        assert all(T.WORDS[int(x)].startswith("v") for x in row[:length][s[:length]])
    # a held-out prompt that the trainer's generator happens to draw is drawn again
    first = T.held_out("kv", length, 10)[0]
    real = T.batch
    calls = []

    def batch(rng, task, L, B, queries=1, depth=None):
        ids, ans, depths, cols = real(rng, task, L, B, queries, depth)
        if not calls:
            ids[0], ans[0] = first.ids, first.answer_ids
        calls.append(B)
        return ids, ans, depths, cols

    monkeypatch.setattr(T, "batch", batch)
    ids, _, _ = train_long.make_batch(0, length, 2, ("kv",), (1.0,))
    rows = {T.digest(row[1:length]) for row in ids}
    assert calls == [2, 1] and T.digest(first.ids) not in rows and len(rows) == 2
    for row in ids:
        assert T.solve(T.text(row[1:length])) == T.text(row[length:][row[length:] != T.EOS])


def test_batches_follow_the_examples():
    """T.batch (vectorised, training) draws what T.sample does: right answers, answered queries
    in the supervised columns, needles spread over the depths."""
    rng = np.random.default_rng(4)
    for task in T.TASKS:
        for length, q in ((32, 3), (200, 8), (1000, 1)):
            ids, ans, depths, cols = T.batch(rng, task, length, 50, q)
            assert ids.shape == (50, length - 1) and ans.shape == (50, T.ANSWER_LEN)
            for r in range(50):
                assert T.solve(T.text(ids[r])) == T.text(ans[r][ans[r] != T.EOS])
                assert all(T.V0 <= ids[r, c] < T.W0 for c in cols)
            if length == 1000:
                assert depths.min() < 0.15 and depths.max() > 0.85


def test_loss_masks_only_supervised_tokens():
    """masked_loss: the model sees the prompt intact, <|mask|> only at supervised tokens (at
    least one answer slot), and the loss is the mean cross-entropy over exactly those."""
    train_long = _train_long()
    ids, sup, _ = train_long.make_batch(5, 96, 64, ("kv", "niah"), (1.0, 1.0), queries=4)
    ids, sup = torch.from_numpy(ids), torch.from_numpy(sup)
    start = int(np.argmax(sup.numpy().any(0)))
    assert start < 96 - T.ASK and not sup[:, :start].any()
    seen = {}

    class Spy(torch.nn.Module):
        def forward(self, noisy, out_from):
            seen["noisy"], seen["from"] = noisy, out_from
            return torch.zeros(noisy.shape[0], noisy.shape[1] - out_from, len(T.WORDS), requires_grad=True)

    g = torch.Generator().manual_seed(0)
    loss, logits, masked, tgt = train_long.masked_loss(Spy(), ids, sup, start, torch.autocast("cpu", enabled=False), g)
    noisy = seen["noisy"]
    assert seen["from"] == start and torch.equal(tgt, ids[:, start:])
    hidden = noisy == T.MASK
    assert not (hidden & ~sup).any()                           # the prompt is never masked
    assert torch.equal(noisy[~hidden], ids[~hidden])
    assert hidden[:, -T.ANSWER_LEN:].any(1).all()              # at least one answer slot per row
    assert torch.equal(masked, hidden[:, start:])
    assert 0.2 < hidden[sup].float().mean() < 0.8              # t ~ U(0, 1): about half
    assert loss.item() == pytest.approx(np.log(len(T.WORDS)), rel=1e-6)   # uniform logits


def test_vocab_and_tokenizer_round_trip(tmp_path):
    """The saved word-level tokenizer encodes a prompt to the ids the trainer used (BOS first)
    and decodes an answer back to its text; ids of the specials match the config."""
    import argparse
    import json

    from mosaic import load

    voc = T.vocab()
    assert len(voc) == len(T.WORDS) and len(set(voc.values())) == len(voc)
    assert all(voc[w] == i for i, w in enumerate(T.SPECIALS))
    assert all(" " not in w for w in T.WORDS)
    train_long = _train_long()
    args = argparse.Namespace(d=16, layers=1, heads=2, ffn=16, rope_theta=5e5)
    train_long.save(train_long.LongLLaDA(len(voc), 16, 1, 2, 16, 5e5), tmp_path, args, {})
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["mask_token_id"], cfg["eos_token_id"], cfg["bos_token_id"]) == (T.MASK, T.EOS, T.BOS)
    tok = load(tmp_path, "cpu", "float32").tokenizer
    ex = T.sample(np.random.default_rng(0), "niah", 300)
    assert tok.encode(ex.prompt) == [T.BOS] + ex.ids.tolist()
    assert tok.decode(ex.answer_ids.tolist()) == ex.answer


def test_trainer_model_matches_engine(tmp_path):
    """tools/train_long.py's model, saved in LLaDA's layout, computes what the engine computes."""
    import argparse

    from mosaic import load
    from mosaic.runtime.runner import NativeRunner

    train_long = _train_long()
    torch.manual_seed(0)
    args = argparse.Namespace(d=32, layers=2, heads=2, ffn=48, rope_theta=5e5)
    model = train_long.LongLLaDA(len(T.vocab()), args.d, args.layers, args.heads, args.ffn, args.rope_theta)
    with torch.no_grad():  # bf16-exact weights, so that the saved copy is the same model
        for p in model.parameters():
            p.copy_((p + 0.05 * torch.randn_like(p)).to(torch.bfloat16).float())
    train_long.save(model, tmp_path, args, {})
    engine_model = load(tmp_path, "cpu", "float32")
    ids = torch.randint(0, len(T.WORDS), (2, 70))
    with torch.no_grad():
        ours = model(ids, 60)
        theirs = NativeRunner(engine_model).forward(ids, None)[:, 60:]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_trainer_model_matches_a_naive_reference():
    """LongLLaDA against a loop-by-loop reference written from LLaDA's definition (pre-norm
    RMSNorm, rotate-half RoPE on positions 0..L-1, bidirectional softmax attention with no mask,
    SwiGLU, no biases), in float64: the engine test above cannot catch a bug both share."""
    import math

    train_long = _train_long()
    torch.manual_seed(1)
    d, H, V, L = 16, 2, 40, 9
    hd = d // H
    m = train_long.LongLLaDA(V, d, 2, H, 24, 5e5).double()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    ids = torch.randint(0, V, (2, L))

    def rms(v, w):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-5) * w

    def rope(v, pos):  # pairs (i, i + hd / 2) turn by pos * theta^(-2i / hd)
        out = v.clone()
        for i in range(hd // 2):
            a, b, th = v[i], v[i + hd // 2], pos * 5e5 ** (-2 * i / hd)
            out[i] = a * math.cos(th) - b * math.sin(th)
            out[i + hd // 2] = b * math.cos(th) + a * math.sin(th)
        return out

    x = m.emb.weight[ids]
    for blk in m.blocks:
        h = rms(x, blk.n1)
        wq, wk, wv = blk.qkv.weight.chunk(3, 0)
        q, k, v = h @ wq.T, h @ wk.T, h @ wv.T
        o = torch.zeros_like(x)
        for b in range(2):
            for head in range(H):
                sl = slice(head * hd, (head + 1) * hd)
                Q = torch.stack([rope(q[b, i, sl], i) for i in range(L)])
                K = torch.stack([rope(k[b, i, sl], i) for i in range(L)])
                o[b, :, sl] = torch.softmax(Q @ K.T / math.sqrt(hd), -1) @ v[b, :, sl]
        x = x + o @ blk.o.weight.T
        g, u = (rms(x, blk.n2) @ blk.gate_up.weight.T).chunk(2, -1)
        x = x + (F.silu(g) * u) @ blk.down.weight.T
    ref = rms(x, m.nf) @ m.head.weight.T
    with torch.no_grad():
        # RoPE runs in float32 (rope_full_precision), hence 1e-5, not float64 round-off
        torch.testing.assert_close(m(ids, 3), ref[:, 3:], atol=1e-5, rtol=1e-5)


def test_rope_relative_at_16k():
    """RoPE tables in float32 keep q.k a function of the distance alone out to 16k tokens."""
    train_long = _train_long()
    m = train_long.LongLLaDA(len(T.WORDS), 64, 1, 1, 16, 5e5)
    cos, sin = m.rope_tables(16400)
    q, k = torch.randn(64), torch.randn(64)

    def score(i, j):
        return (m.rope(q, cos[i], sin[i]) * m.rope(k, cos[j], sin[j])).sum().item()

    for far in (8000, 16000):
        assert score(far + 7, far) == pytest.approx(score(7, 0), abs=2e-3)


def _layer_scores(tl, model, ids, layer):
    """Attention probabilities [B, heads, L, L] of `layer` (the trainer's forward up to it)."""
    B, L = ids.shape
    d, hd = model.d, model.hd
    cos, sin = model.rope_tables(L)
    x = model.emb(ids)
    for i, b in enumerate(model.blocks):
        h = F.rms_norm(x, (d,), b.n1, 1e-5)
        q, k, v = b.qkv(h).view(B, L, 3, model.heads, hd).permute(2, 0, 3, 1, 4)
        q, k = model.rope(q, cos, sin), model.rope(k, cos, sin)
        if i == layer:
            return ((q @ k.transpose(-1, -2)) / hd ** 0.5).softmax(-1)
        x = x + b.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, d))
        g, u = b.gate_up(F.rms_norm(x, (d,), b.n2, 1e-5)).chunk(2, -1)
        x = x + b.down(F.silu(g) * u)


@torch.no_grad()
def test_offset_heads_attend_to_their_offset_at_16k():
    """The structured init's layer-0 heads (d 256, head dim 64, theta 5e5): every query row puts
    nearly all its attention on the token `offset` before it, also 16k tokens in."""
    tl = _train_long()
    torch.manual_seed(0)
    model = tl.LongLLaDA(len(tl.VOCAB), 256, 1, 4, 64, 5e5)
    offsets = (1, 2, 3, -1)
    tl.init_offset_heads(model, offsets, span=16400)
    L = 16384
    ids = torch.randint(len(tl.VOCAB), (1, L))
    b = model.blocks[0]
    h = F.rms_norm(model.emb(ids), (model.d,), b.n1, 1e-5)
    q, k, _ = b.qkv(h).view(1, L, 3, model.heads, model.hd).permute(2, 0, 3, 1, 4)
    cos, sin = model.rope_tables(L)
    q, k = model.rope(q, cos, sin), model.rope(k, cos, sin)
    rows = torch.tensor([7, 300, 5000, 12345, L - 2])
    for j, o in enumerate(offsets):
        p = ((q[0, j, rows] @ k[0, j].T) / model.hd ** 0.5).softmax(-1)
        assert torch.equal(p.argmax(-1), rows - o), (o, p.argmax(-1))
        assert p.max(-1).values.min() > 0.99, o


@torch.no_grad()
def test_match_heads_find_the_asked_record():
    """Offset heads + matching heads at init, on kv prompts: layer-1 head 0 sends answer slot 0
    to the asked record's first value word (the token after the asked key) far more often than
    chance (1 in 64), never to a masked slot (the mask penalty: q = k would attend to itself)."""
    tl = _train_long()
    torch.manual_seed(0)
    model = tl.LongLLaDA(len(tl.VOCAB), 128, 2, 2, 256, 5e5)
    info = tl.init_offset_heads(model, (1, 2))
    tl.init_match_heads(model, 1, info["out"], info["u"], 16)
    L = 64
    ids, _, _ = tl.make_batch(1, L, 64, ("kv",), (1.0,), 1)
    ids = torch.from_numpy(ids)
    ids[:, L:] = T.MASK
    a1 = _layer_scores(tl, model, ids, 1)
    key_at = torch.tensor([r.tolist().index(r[L - 1].item()) for r in ids])
    top = a1[:, 0, L].argmax(-1)
    assert (top == key_at + 1).float().mean() > 0.3
    assert (top < L).all()


def test_bundled_tiny_long_answers_through_the_engine():
    """The shipped long-context model (trained on an H200, gpu/train_long_bundled.log) answers
    held-out prompts of every task through the planned path on the CPU; 256-token contexts keep
    this to seconds (its table at 4k-16k is in its long_accuracy.json)."""
    from mosaic import MosaicEngine
    from mosaic.loader import BUNDLED
    acc = __import__("json").loads((BUNDLED["tiny-long"] / "long_accuracy.json").read_text())
    assert {c["task"] for c in acc["cells"]} == set(T.TASKS)
    engine = MosaicEngine("tiny-long", {"device": "cpu", "progress": False})
    res = T.evaluate(engine, T.TASKS, [256], n=4)
    exact = {c["task"]: c["exact"] for c in res["cells"]}
    assert all(v >= 0.75 for v in exact.values()), exact


def test_tiny_long_names_unknown_words_not_characters():
    from mosaic.errors import InputError
    from mosaic.loader import BUNDLED
    from mosaic.tokenizer import TextTokenizer
    tok = TextTokenizer.from_folder(BUNDLED["tiny-long"])
    assert tok.encode("k17 v3 ? k17")
    with pytest.raises(InputError, match=r"words this tokenizer does not know: 'k99999', 'w'; .* k0 k1"):
        tok.encode("k99999 v3 w ? k17")


def test_cli_separates_a_word_level_prompt_from_its_answer(capsys):
    from mosaic.cli import main
    prompt = "k17 v3 v250 k402 v9 v91 k88 v1 v77 ? k402"
    assert main(["generate", "--model", "tiny-long", "--no-progress", "--prompt", prompt]) == 0
    assert capsys.readouterr().out.strip() == prompt + " v9 v91"
