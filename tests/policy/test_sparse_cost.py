"""The cost model's figures are the committed H200 records', and it reproduces their sparse steps."""

import json
from pathlib import Path

import pytest

from mosaic.policy import sparse_cost as C
from mosaic.policy.sparse_recall import Candidate

GPU = Path(__file__).resolve().parents[2] / "bench" / "results" / "gpu"


def test_the_constants_are_the_committed_measurements():
    att = json.loads((GPU / "bench_attention.json").read_text())["records"]
    sdpa = next(r for r in att if r["case"] == "llada 128kx128k" and r["impl"] == "sdpa (reference.attention)")
    assert sdpa["ms"] == pytest.approx(C.H200_SDPA_MS_128K)
    pts = [(r["density"], r["ms"]) for r in att if r["case"] == "llada 128k sparse"]
    slope = sum(d * ms for d, ms in pts) / sum(d * d for d, _ in pts)     # least squares through 0
    assert slope == pytest.approx(C.H200_SPARSE_MS_PER_DENSITY_128K)
    full = json.loads((GPU / "bench_sparse.json").read_text())["full"][0]
    assert full["tokens"] == C.N128K and full["ms"]["dense"] == pytest.approx(C.H200_DENSE_STEP_MS_128K)


@pytest.mark.parametrize("keep", [0.1, 0.2])
def test_the_model_reproduces_the_measured_sparse_steps(keep):
    full = json.loads((GPU / "bench_sparse.json").read_text())["full"][0]
    r = C.step_ms(C.Geometry.llada_8b(), [Candidate("topk", keep)] * 32, 128, "minmax")
    assert r["ms"] == pytest.approx(full["ms"][f"topk {keep}"], rel=0.02)
    assert r["dense_ms"] == pytest.approx(full["ms"]["dense"], rel=1e-9)


def test_dense_is_one_and_sparser_is_faster():
    g = C.Geometry.llada_8b()
    assert C.step_ms(g, [None] * 32, 128)["speedup"] == pytest.approx(1.0)
    s1 = C.step_ms(g, [Candidate("topk", 0.3)] * 32, 128)["speedup"]
    s2 = C.step_ms(g, [Candidate("topk", 0.1)] * 32, 128)["speedup"]
    assert 1 < s1 < s2
    with pytest.raises(ValueError):
        C.step_ms(g, [None] * 4, 128)
