"""A captured step's static inputs (runtime/graph_rules.static_inputs / make_static_inputs): the
ids, positions, rows and a batched block step's index tensors are views into one int64 tensor,
so the set opens one segment at most, what a request's graph charge holds per input set
(policy/graph_charge.py); each view keeps its tensor's dtype, shape and values."""

from types import SimpleNamespace

import torch

from mosaic.memory.caching import segment_bytes
from mosaic.runtime.graph_rules import input_set_bytes, make_static_inputs, static_inputs


class Cache:
    def __init__(self, tensors):
        self.tensors = tensors

    def graph_inputs(self):
        return self.tensors


def _step(extra):
    ids = torch.arange(12).view(3, 4)
    return SimpleNamespace(ids=ids, positions=ids + 100, rows=torch.tensor([0, 5]), cache=Cache(extra))


def test_the_index_tensors_share_the_input_sets_one_tensor():
    i32 = torch.int32
    extra = {"cu_q": torch.tensor([0, 4, 8, 12], dtype=i32), "k_start": torch.tensor([7, 9, 11], dtype=i32),
             "k_used": torch.tensor([1, 2, 3], dtype=i32), "write_rows": torch.arange(5) * 3}
    step = _step(extra)
    key, nbytes, got_extra = static_inputs(step, 4)
    words = 2 + 2 + 2 + 5                            # int32 tensors rounded up to whole 8-byte words
    assert nbytes == input_set_bytes((3, 4), 4, words) == segment_bytes(8 * (2 * 12 + 4 + words))
    assert nbytes < 2 * segment_bytes(1)             # one segment, not one per index tensor
    made = make_static_inputs(step, 4, got_extra)
    assert made["ids"].shape == (3, 4) and made["rows"].shape == (4,)
    for name, t in extra.items():
        assert made[name].dtype == t.dtype and torch.equal(made[name], t)
    bases = {made[k].untyped_storage().data_ptr() for k in made}
    assert len(bases) == 1                           # one allocation
    assert key != static_inputs(_step({**extra, "write_rows": torch.arange(6)}), 4)[0]   # shapes key the set


def test_a_plain_step_has_no_index_words():
    step = _step({})
    key, nbytes, extra = static_inputs(step, 2)
    assert extra == {} and nbytes == input_set_bytes((3, 4), 2)
