"""The compiled constraint (runtime/grammar.py) and the canvas rule (samplers/constraint.py), on
small vocabularies: distances, length-aware masks, the three sampler calls, the reducer's walk."""

from __future__ import annotations

import json

import pytest
import torch

from mosaic.config.structured import ConstraintSpec, spec_of, spec_of_response_format
from mosaic.errors import InputError
from mosaic.runtime.grammar import Compiler, byte_alphabet, escape
from mosaic.runtime.samplers.constraint import CanvasConstraint, ConstrainedReducer

pytest.importorskip("outlines_core")


class Tok:
    """A stand-in for TextTokenizer over a literal vocabulary (one character per token)."""

    def __init__(self, chars):
        from tokenizers import Tokenizer, models
        vocab = {c: i for i, c in enumerate(chars)}
        self.tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=chars[0]))


CHARS = list("0123456789ab\"{}:,[] ") + ["<eos>"]
EOS = len(CHARS) - 1


def compiler():
    return Compiler(Tok(CHARS), len(CHARS) + 2, EOS)


def test_distances_and_length_aware_masks():
    g = compiler().compile(spec_of(regex="a[0-9]{1,3}b"))
    assert g.dist[g.initial] == 3                      # a, one digit, b
    s = g.advance(g.initial, CHARS.index("a"))
    # with 2 positions left after this one any digit fits; with 1 left only 'b' may not come yet ...
    m2 = g.mask(s, 2, "cpu")
    assert m2[CHARS.index("5")] and not m2[CHARS.index("b")] and not m2[EOS]
    s = g.advance(s, CHARS.index("5"))
    m0 = g.mask(s, 0, "cpu")                           # no room left: only the closing 'b'
    assert m0.nonzero().flatten().tolist() == [CHARS.index("b")]
    m5 = g.mask(s, 5, "cpu")
    assert m5[CHARS.index("b")] and m5[CHARS.index("7")]
    end = g.advance(s, CHARS.index("b"))
    assert end in g.finals and g.mask(end, 3, "cpu").nonzero().flatten().tolist() == [EOS]
    assert g.allows(end, EOS, 0) and not g.allows(s, EOS, 4)


def test_compile_errors_name_the_problem():
    c = compiler()
    with pytest.raises(InputError, match="shortest answer .* 3 tokens, more than max_tokens 2"):
        c.compile(spec_of(regex="a[0-9]b"), 2)
    with pytest.raises(InputError, match="cannot be compiled"):
        c.compile(spec_of(regex="(a"))
    with pytest.raises(InputError, match="context-free grammars are not supported"):
        c.compile(ConstraintSpec("grammar", "root ::= 'a'", "guided_grammar"))
    with pytest.raises(InputError, match="cannot be compiled"):
        c.compile(spec_of(regex="xyz"))                # no token spells x
    with pytest.raises(InputError, match="one output constraint"):
        spec_of(regex="a", choice=["a"])
    with pytest.raises(InputError, match="non-empty list"):
        spec_of(choice="ab")
    with pytest.raises(InputError, match="'text', 'json_object', 'json_schema'"):
        spec_of_response_format({"type": "yaml"})
    assert spec_of_response_format({"type": "text"}) is None
    assert json.loads(spec_of_response_format({"type": "json_object"}).value)["type"] == "object"


def test_choice_escapes_and_compiles():
    assert escape("a.b(c)") == "a\\.b\\(c\\)"
    g = compiler().compile(spec_of(choice=["a1", "a2b", "{}"]))
    assert g.dist[g.initial] == 2


def test_byte_alphabet_is_a_bijection():
    inv = byte_alphabet()
    assert sorted(inv.values()) == list(range(256)) and inv["Ġ"] == 32


def test_window_prefix_and_commit():
    g = compiler().compile(spec_of(regex="[0-9]{2,4}"))
    C = CanvasConstraint(g, [(2, 8), (2, 8)], mask_id=99, eos_ids=(EOS,))
    cand = torch.tensor([[False, False] + [True] * 6, [False, False] + [True] * 6])
    w = C.restrict(cand, counts=[2, 3])
    assert w[0].nonzero().flatten().tolist() == [2, 3] and w[1].nonzero().flatten().tolist() == [2, 3, 4]
    chosen = torch.zeros(2, 8, dtype=torch.bool)
    chosen[0, 5], chosen[1, 3] = True, True            # the sampler chose later positions
    assert C.prefix(chosen)[0].nonzero().flatten().tolist() == [2]
    chosen[1, 2] = True
    assert C.prefix(chosen, run=True)[1].nonzero().flatten().tolist() == [2, 3]
    x = torch.full((2, 8), 99)
    x[0, 2:4] = torch.tensor([1, 2])
    x[1, 2:5] = torch.tensor([3, EOS, 99])
    C.commit(x)
    assert C.front == [4, 8] and x[1, 3:].tolist() == [EOS] * 5 and C.state[0] in g.next


class Argmax:
    """A family reducer stand-in: x0 = argmax, conf = max softmax."""
    fused = None

    def signature(self):
        return ("argmax",)

    def outputs(self, dtype):
        return [("x0", torch.int64), ("conf", dtype)]

    def transient_bytes(self, m, V, dtype):
        return 0

    def finish(self):
        pass

    def __call__(self, lg, lu, a, b, outs):
        p = torch.softmax(lg, -1)
        outs["conf"].copy_(p.max(-1).values)
        outs["x0"].copy_(p.argmax(-1))


def test_reducer_walk_masks_only_the_rows_it_must():
    g = compiler().compile(spec_of(regex="a[0-9]b"))
    V = len(CHARS) + 2
    C = CanvasConstraint(g, [(0, 4)], mask_id=V - 1, eos_ids=(EOS,))
    lg = torch.full((4, V), -5.0)
    lg[0, CHARS.index("a")] = 5          # allowed: kept
    lg[1, CHARS.index("b")] = 5          # not allowed after 'a': masked, the best digit wins
    lg[1, CHARS.index("7")] = 1
    lg[2, CHARS.index("b")] = 5
    lg[3, CHARS.index("3")] = 5          # after 'a7b' only end-of-text
    r = ConstrainedReducer(Argmax(), C, torch.arange(4), 4, V)
    assert [o[0] for o in r.outputs(torch.float32)] == ["x0", "conf", "logits"] and r.fused is None
    outs = {"x0": torch.zeros(4, dtype=torch.long), "conf": torch.zeros(4), "logits": torch.zeros(4, V)}
    r(lg.clone(), None, 0, 4, outs)                    # the device half: free tokens, logits saved
    assert [CHARS[i] for i in outs["x0"].tolist()] == ["a", "b", "b", "3"] and torch.equal(outs["logits"], lg)
    walked = r.walk(outs)                              # the host half
    assert "logits" not in walked and [CHARS[i] for i in walked["x0"].tolist()] == ["a", "7", "b", "<eos>"]
    assert C.positions_masked == 2 and C.pending == {0: walked["x0"].tolist()}
    assert r.signature() == ConstrainedReducer(Argmax(), C, torch.arange(2), 4, V).signature()   # one template
    x = torch.full((1, 4), V - 1)
    x[0] = walked["x0"]
    C.granted[0] = 4
    C.commit(x)                                        # from the walk's tokens, not the canvas
    assert C.front == [4] and C.state[0] in g.finals and C.pending == {}
