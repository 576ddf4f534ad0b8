"""The chooser takes the cheapest candidate meeting the target; configs from choices; the
32-layer scaling rule; measurement on a tiny random model."""

import torch
from conftest import random_model

from mosaic.config import SparseConfig, SparseRange
from mosaic.policy import sparse_choice as SC
from mosaic.policy.sparse_cost import Geometry, scale_choices
from mosaic.policy.sparse_measure import RecallTable, measure
from mosaic.policy.sparse_recall import DEFAULT_GRID, Candidate

GRID = (Candidate("dense"), Candidate("topk", 0.1), Candidate("topk", 0.3), Candidate("topk", 0.5))
G = Geometry(3, 64, 4, 4, 16, 128, 100, 4096, 2048)


def _table(recalls):
    """recalls: per layer {label: recall}, the same for every head and row kind."""
    t = RecallTable(64, ("minmax",), GRID, key_blocks=64)
    t.entropy = [[0.5] * 4 for _ in recalls]
    for c in GRID:
        per_layer = [[r.get(c.label, 1.0 if c.pattern == "dense" else 0.0)] * 4 for r in recalls]
        t.recall[("minmax", c.label)] = per_layer
        t.recall_masked[("minmax", c.label)] = per_layer
    return t


def test_the_cheapest_candidate_meeting_the_target_wins():
    t = _table([{"topk 0.1": 0.99, "topk 0.3": 0.999, "topk 0.5": 1.0},     # the cheapest passes
                {"topk 0.1": 0.80, "topk 0.3": 0.94, "topk 0.5": 0.96},      # only the dearest sparse one
                {"topk 0.1": 0.50, "topk 0.3": 0.60, "topk 0.5": 0.70}])     # none: dense
    got = SC.choose_layers(t, G, "minmax", 0.95)
    assert [c.candidate and c.candidate.label for c in got] == ["topk 0.1", "topk 0.5", None]
    assert [x["label"] for x in got[2].tried] == ["topk 0.1", "topk 0.3", "topk 0.5"]
    # a looser target moves layer 1 down to the cheaper pattern
    assert SC.choose_layers(t, G, "minmax", 0.9)[1].candidate.label == "topk 0.3"


def test_masked_rows_count_too():
    t = _table([{"topk 0.1": 0.99}])
    t.recall_masked[("minmax", "topk 0.1")] = [[0.5] * 4]            # the answer rows lose their mass
    g1 = Geometry(1, 64, 4, 4, 16, 128, 100, 4096, 2048)
    assert SC.choose_layers(t, g1, "minmax", 0.95)[0].candidate is None        # dense
    assert SC.choose_layers(t, g1, "minmax", 0.5)[0].candidate.label == "topk 0.1"


def test_config_of_choices_merges_adjacent_layers_and_round_trips():
    a, b = Candidate("topk", 0.1), Candidate("window", window=2)
    choices = [None, a, a, b, None, a]
    cfg = SC.to_sparse_config(choices, 64, "rows", 1)
    assert cfg == SparseConfig((SparseRange((1, 2), "topk", 0.1), SparseRange((3, 3), "window", 1.0, 2),
                                SparseRange((5, 5), "topk", 0.1)), block=64, dense_steps=1, estimate="rows")
    assert SC.choices_of(cfg, 6) == choices
    assert SC.to_sparse_config([None, None], 64, "minmax") is None


def test_scaling_to_32_layers_by_relative_depth():
    four = ["a", "b", "c", "d"]
    scaled = scale_choices(four, 32)
    assert scaled == [four[i * 4 // 32] for i in range(32)]
    assert scaled[:8] == ["a"] * 8 and scaled[-8:] == ["d"] * 8


def test_measure_on_a_tiny_random_model():
    torch.manual_seed(0)
    m = random_model("llada", num_layers=2)
    ids = torch.randint(0, 30, (128,))
    ids[100:] = m.cfg.mask_id
    t = measure(m, [ids, ids.clone()], 16, DEFAULT_GRID[:3], ("minmax",))
    assert t.canvases == 2 and t.key_blocks == 8 and len(t.entropy) == 2
    for layer in range(2):
        assert t.layer_recall("minmax", "dense", layer, "min") > 0.9999
        assert t.layer_recall("minmax", "topk 0.05", layer) < t.layer_recall("minmax", "topk 0.1", layer) + 1e-6
        assert 0 < sum(t.entropy[layer]) / 4 <= 1


def test_back_off_undoes_a_step_that_does_not_help():
    a = Candidate("window", window=1, global_blocks=0)
    calls = []

    def loss(ch):                      # only layer 1 sparse loses points (tiny-long at 2k)
        calls.append(list(ch))
        return 50.0 if ch[1] is not None else 0.0

    final, steps = SC.back_off([a, a, a, a], [2, 3, 0, 1], loss, 50.0, 1.0)
    assert final == [a, None, a, a] and len(calls) == 4
    assert [s["dense_now"] for s in steps] == [False, False, False, True]


def test_back_off_ends_all_dense_when_no_single_layer_helps():
    a = Candidate("topk", 0.1)
    final, steps = SC.back_off([a, a, None], [0, 1], lambda ch: 30.0, 30.0, 1.0)
    assert final == [None, None, None] and steps[-1] == {"all_dense": True, "loss_before": 30.0}
    assert SC.back_off([a], [0], lambda ch: 9.0, 0.5, 1.0) == ([a], [])      # already within the target
