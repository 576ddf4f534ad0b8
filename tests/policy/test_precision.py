"""Per-layer FP8: the chooser (an exact knapsack), sensitivity scores, config forms, weight
accounting and the engine's labels."""

import itertools
import random

import pytest
from conftest import bundled, random_model

from mosaic import InputError, MosaicEngine
from mosaic.config import EngineConfig, PrecisionConfig
from mosaic.models.precision import apply_precision, layer_bytes_as, quantize_layer, ranges
from mosaic.policy.precision import choose_fp8, plan_precision
from mosaic.policy.sensitivity import calibration_canvases, kl_sensitivity, local_sensitivity


def brute(costs, savings, need):
    best = None
    for pick in itertools.product([0, 1], repeat=len(costs)):
        if sum(s for s, p in zip(savings, pick) if p) >= need:
            c = sum(x for x, p in zip(costs, pick) if p)
            best = c if best is None else min(best, c)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_chooser_is_the_least_sensitivity_that_meets_the_target(seed):
    rng = random.Random(seed)
    n = rng.randint(3, 9)
    costs = [rng.random() for _ in range(n)]
    savings = [rng.randint(1, 20) * 1000 for _ in range(n)]
    need = rng.randint(1, sum(savings))
    pick = choose_fp8(costs, savings, need)
    assert sum(s for s, p in zip(savings, pick) if p) >= need
    assert sum(c for c, p in zip(costs, pick) if p) == pytest.approx(brute(costs, savings, need))


def test_chooser_edges():
    assert choose_fp8([1.0, 2.0], [10, 10], 0) == [False, False]
    assert choose_fp8([3.0, 1.0, 2.0], [10, 10, 10], 15) == [False, True, True]
    with pytest.raises(InputError, match="saves only"):
        choose_fp8([1.0], [10], 11)


def test_config_forms():
    as_list = EngineConfig(precision=[{"layers": [0, 1], "dtype": "bf16"}, {"layers": [2, 5], "dtype": "fp8"}])
    assert isinstance(as_list.precision, PrecisionConfig)
    assert [as_list.precision.for_layer(i) for i in range(7)] == ["model"] * 2 + ["fp8"] * 4 + ["model"]
    for bad, msg in ([{"layers": [0, 2]}, {"layers": [2, 3]}], "both cover layer 2"), \
            ({"auto": True}, "needs target_weight_bytes"), ({"method": "hessian"}, "method"), \
            ([{"layers": [0, 1], "dtype": "int4"}], "dtype"):
        with pytest.raises(InputError, match=msg):
            EngineConfig(precision=bad)


def test_fp8_layer_bytes_and_ranges():
    model = random_model("llada", num_layers=4)
    before = model.weight_bytes()
    pred = [layer_bytes_as(lw, "fp8") for lw in model.layers]
    apply_precision(model, ["fp8", "model", "fp8", "fp8"])
    assert model.quantized and model.layer_bytes()[0] == pred[0] and model.layer_bytes()[1] < before
    assert model.weight_bytes() < before
    assert ranges(model.precision) == [{"layers": [0, 0], "dtype": "fp8"}, {"layers": [1, 1], "dtype": "fp32"},
                                       {"layers": [2, 3], "dtype": "fp8"}]
    assert quantize_layer(model.layers[0]) is model.layers[0]
    with pytest.raises(InputError, match="already FP8"):
        apply_precision(model, ["model"] * 4)


def test_sensitivities_are_positive_and_rank_a_damaged_layer_first():
    model = random_model("llada", num_layers=3)
    x = calibration_canvases(model, 4, length=16)
    base_kl, base_local = kl_sensitivity(model, x), local_sensitivity(model, x)
    assert len(base_kl) == 3 and min(base_kl) > 0 and min(base_local) > 0
    # an outlier feature (LLM.int8, Dettmers et al. 2022) in layer 1's inputs that its matrices
    # ignore: per-token scales follow the outlier, every channel that matters turns coarse
    lw = model.layers[1]
    lw["attn_norm"][0] = lw["ffn_norm"][0] = 2000.0
    for k in ("q", "k", "v", "gate", "up"):
        lw[k][:, 0] = 0.0
    assert max(range(3), key=local_sensitivity(model, x).__getitem__) == 1


def test_auto_precision_meets_the_target_on_the_bundled_model():
    bundled("tiny-llada")
    eng = MosaicEngine("tiny-llada", {"device": "cpu", "progress": False,
                                      "precision": {"auto": True, "target_weight_bytes": 0.6, "calibration": 8}})
    rep = eng.precision_report
    assert rep["weight_bytes"] <= rep["target_bytes"] and eng.model.weight_bytes() == rep["weight_bytes"]
    assert len(rep["sensitivity"]) == 6 and "fp8" in rep["dtypes"]
    out = eng.generate("sort 31415926=", max_new_tokens=8, steps=8)
    assert any("FP8 weights" in lab for lab in out.lossy) and out.precision == rep["dtypes"]


def test_fp8_engine_budget_counts_fp8_bytes_and_plans_every_layer_alike():
    model = random_model("dream", num_layers=3)
    bf = model.weight_bytes()
    eng = MosaicEngine(model, {"device": "cpu", "progress": False, "sanitize": True, "offload": "weights",
                               "precision": {"ranges": [{"layers": [1, 1], "dtype": "fp8"}], "embed": "fp8"}})
    assert eng.budget.weights_bytes == model.weight_bytes() < bf and "embed_scale" in model.extra
    out = eng.generate([[3, 4, 5, 6]], max_new_tokens=4, steps=2)       # mixed layers share one template
    assert out.tokens.shape == (1, 4)


def test_plan_precision_refuses_ranges_past_the_model():
    model = random_model("llada", num_layers=2)
    with pytest.raises(InputError, match="layers 0-1"):
        plan_precision(model, PrecisionConfig(ranges=({"layers": [0, 5], "dtype": "fp8"},)))


def test_bundled_model_keeps_its_answers_in_fp8():
    bundled("tiny-llada")
    eng = MosaicEngine("tiny-llada", {"device": "cpu", "progress": False,
                                      "precision": [{"layers": [0, 5], "dtype": "fp8"}]})
    out = eng.generate(["sort 31415926=", "57+384="], max_new_tokens=8, steps=8)
    assert out.texts == ["11234569", "441"]
