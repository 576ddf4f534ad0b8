"""Sequence parallelism on 2-3 CPU processes (gloo): the same tokens as one process."""

import pytest
import torch
from ranks import run, single

CASES = [
    ("llada", dict(max_new_tokens=12, steps=6), 1),
    ("llada", dict(max_new_tokens=12, steps=6, block_length=4, temperature=0.7, seed=3), 2),
    ("llada", dict(max_new_tokens=8, steps=8, cfg_scale=1.0, remasking="random", seed=1), 1),
    ("llada_moe", dict(max_new_tokens=10, steps=5), 2),
    ("dream", dict(max_new_tokens=10, steps=5, alg="entropy"), 2),
    ("dream", dict(max_new_tokens=10, steps=10, alg="origin", seed=4), 1),
    ("dream", dict(max_new_tokens=10, steps=5, alg="topk_margin", top_k=9), 2),
]


# one case per family in the default run; the rest are exhaustive (slow)
_FIRST = {f: i for i, (f, _, _) in reversed(list(enumerate(CASES)))}


@pytest.mark.parametrize("family, case, batch",
                         [c if _FIRST[c[0]] == i else pytest.param(*c, marks=pytest.mark.slow)
                          for i, c in enumerate(CASES)],
                         ids=[f"{f}-{'-'.join(f'{k}={v}' for k, v in c.items())}-b{b}" for f, c, b in CASES])
def test_two_ranks_give_the_single_process_tokens(tmp_path, family, case, batch):
    one = single(family, case, batch).tokens
    outs = run(tmp_path, 2, family, case, batch)
    assert all(torch.equal(o, one) for o in outs)


@pytest.mark.slow
def test_three_ranks_chunked_bundled(tmp_path):
    case = dict(max_new_tokens=8, steps=8)
    one = single("tiny-llada", case, 2)
    outs = run(tmp_path, 3, "tiny-llada", case, 2, chunks=(2, 3, 2))
    assert all(torch.equal(o, one.tokens) for o in outs)
    assert one.texts[0] == "01236789"


@pytest.mark.parametrize("family", ["llada", pytest.param("dream", marks=pytest.mark.slow)])
def test_peer_shards_in_pieces(tmp_path, family):
    case = dict(max_new_tokens=10, steps=5) if family == "llada" else dict(max_new_tokens=10, steps=5,
                                                                            alg="maskgit_plus")
    one = single(family, case, 2).tokens
    outs = run(tmp_path, 2, family, case, 2, chunks=(2, 1, 1), peer_rows=3)
    assert all(torch.equal(o, one) for o in outs)
