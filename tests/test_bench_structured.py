"""`python -m bench structured`: the GPU part's measurement (step_cost) and the byte-level
tokenizer it gives a preset, run on the CPU on a random byte-level checkpoint with a captured-graph
fake, so the lead's H200 run measures what it says (docs/STRUCTURED.md)."""

import pytest
from fake_graphs import FakeGraphs

from bench.lib.byte_models import byte_checkpoint
from bench.suites.structured import byte_compiler, step_cost
from mosaic import MosaicEngine
from mosaic.runtime.graphs import StepGraphs

pytest.importorskip("outlines_core")

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["id", "ok"]}


def test_step_cost_measures_free_and_constrained_with_replayed_steps(tmp_path):
    e = MosaicEngine(str(byte_checkpoint("llada", tmp_path / "llada", 0)), {"device": "cpu", "progress": False})
    byte_compiler(e)
    e.runner.graphs = StepGraphs(FakeGraphs())
    opts = dict(max_new_tokens=32, block_length=16, steps=32, cache="dual", threshold=0.9)
    res = step_cost(e, list(range(40, 72)), opts, SCHEMA)
    assert res["step_ratio"] > 0 and res["end_to_end_ratio"] > 0 and res["step_kind"] == "block"
    con = res["json_schema"]
    assert con["stats"]["complete"] and any(x.startswith("structured:") for x in con["lossy"])
    assert con["tokens_per_forward"] == 32 / con["forwards"]
    for label in ("free", "json_schema"):    # every forward is one cycle: a fill per block, then its block steps
        cyc = res[label]["cycles"]
        assert cyc["fill"]["count"] == 2 and cyc["fill"]["count"] + cyc["block"]["count"] == res[label]["forwards"]
    # the timed requests replay their steps: constrained ones too (nothing eager after the warm-up)
    for label in ("free", "json_schema"):
        assert res[label]["graphs"]["replays"] > 0 and res[label]["graphs"]["eager"] == 0, (label, res[label])
