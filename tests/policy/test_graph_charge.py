"""Graph memory in admission (policy/graph_charge.py): a request's captured steps are charged
their executables (bytes per op x the step's ops, as measured) and static inputs when they fit
what its steps leave of the budget; a request whose graphs do not fit runs eager, labelled; one
whose steps do not fit is refused as before, its graphs never the reason. A fake graph backend
declares the bytes per op."""

import pytest
import torch
from conftest import random_model
from fake_graphs import FakeGraphs

from mosaic import MemoryBudgetError, MosaicEngine
from mosaic.policy import graph_charge as GC
from mosaic.runtime.graph_rules import input_set_bytes
from mosaic.runtime.graphs import StepGraphs

PER_OP = 4096          # the fake executable's bytes per op
PROMPT, NEW = [3, 4, 5, 6], 8
OPTS = dict(max_new_tokens=NEW, steps=NEW, block_length=4)


def _engine(model, budget, per_op=PER_OP):
    eng = MosaicEngine(model, {"progress": False, "memory_budget": budget})
    graphs = StepGraphs(FakeGraphs())
    graphs.bytes_per_op = per_op
    eng.use_graphs(graphs)
    return eng


def _shape(model):
    """(spare bytes at a 1 GiB budget, one graph's charge, the input sets' charge)."""
    eng = _engine(model, 2**30)
    gen = eng.generation_config(**OPTS)
    adm = eng.admit(1, len(PROMPT) + NEW, gen)
    step = adm.prepared.step
    limit = eng.budget.activation_limit(step.batch, step.length)
    per = GC.per_graph_bytes(adm.prepared, PER_OP)
    inputs = input_set_bytes(tuple(step.ids.shape), step.num_masked)       # one graph's
    return limit - adm.prepared.need_bytes, per, inputs, adm


@pytest.fixture(scope="module")
def model():
    return random_model("llada")


def test_roomy_budget_charges_the_graphs_it_admits(model):
    spare, per, inputs, adm = _shape(model)
    assert adm.captured and adm.graphs.driver_bytes == GC.GRAPHS_WANTED * per
    assert adm.graphs.inputs_bytes == GC.GRAPHS_WANTED * inputs      # an input set per graph
    eng = _engine(model, 2**30)
    plain = MosaicEngine(model, {"progress": False, "memory_budget": 2**30}).admit(
        1, len(PROMPT) + NEW, eng.generation_config(**OPTS))
    assert adm.predicted_bytes == plain.predicted_bytes + GC.GRAPHS_WANTED * (per + inputs)


def test_a_budget_that_holds_the_steps_but_not_their_graphs_runs_eager_and_says_so(model):
    spare, per, inputs, _ = _shape(model)
    budget = 2**30 - spare + GC.GRAPHS_LEAST * (per + inputs) - 1      # one byte short of two graphs
    eng = _engine(model, budget)
    adm = eng.admit(1, len(PROMPT) + NEW, eng.generation_config(**OPTS))
    assert not adm.captured and "eager: captured steps need" in adm.graphs.note
    out = eng.generate(PROMPT, **OPTS)
    g = out.stats["graphs"]
    assert g["mode"] == "eager" and g["captures"] == 0 and g["replays"] == 0 and "eager" in g["note"]
    ref = MosaicEngine(model, {"progress": False}).generate(PROMPT, **OPTS)
    assert torch.equal(out.tokens, ref.tokens)


def test_two_graphs_fit_exactly(model):
    spare, per, inputs, _ = _shape(model)
    eng = _engine(model, 2**30 - spare + GC.GRAPHS_LEAST * (per + inputs))
    adm = eng.admit(1, len(PROMPT) + NEW, eng.generation_config(**OPTS))
    assert adm.captured and adm.graphs.driver_bytes == GC.GRAPHS_LEAST * per
    out = eng.generate(PROMPT, **OPTS)
    assert out.stats["graphs"]["mode"] == "captured" and out.stats["graphs"]["captures"] >= 1


def test_a_request_over_the_budget_is_refused_before_its_graphs_are_considered(model):
    spare, per, inputs, _ = _shape(model)
    fixed = _engine(model, 2**30).budget.fixed_bytes
    eng = _engine(model, fixed + 4096)                  # not even the chunked steps fit
    with pytest.raises(MemoryBudgetError, match="longest that fits"):
        eng.admit(1, len(PROMPT) + NEW, eng.generation_config(**OPTS))
    eng = _engine(model, 2**30 - spare)                 # its steps alone fit: admitted, eager
    adm = eng.admit(1, len(PROMPT) + NEW, eng.generation_config(**OPTS))
    assert not adm.captured


def test_no_budget_charges_nothing_and_offload_or_cfg_is_never_captured(model):
    eng = _engine(model, None)
    adm = eng.admit(1, len(PROMPT) + NEW, eng.generation_config(**OPTS))
    assert adm.captured and adm.graphs.total_bytes == 0
    cfg = eng.admit(1, len(PROMPT) + NEW, eng.generation_config(cfg_scale=1.0, **OPTS))
    assert not cfg.captured and cfg.graphs.note == "eager: cfg"
    step = adm.prepared.step.with_(offload=object())   # a step streaming its layers from host memory
    assert GC.request_problem(step) == "offload (layers streamed from host memory)"


def test_more_measured_bytes_per_op_charge_more(model):
    _, per, _, adm = _shape(model)
    assert GC.per_graph_bytes(adm.prepared, 2 * PER_OP) > per
    assert GC.per_graph_bytes(adm.prepared, 0) == GC.per_graph_bytes(adm.prepared, GC.DEFAULT_BYTES_PER_OP)
