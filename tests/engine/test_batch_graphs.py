"""A running batch's captured steps under a budget (engine/batch_memory.hold_graphs, engine/
device_memory.py batch_graphs): the batch's stacked steps are captured and replayed under what
their stacked step leaves of the budget (one request's own charge held them eager: on the H200
every stacked step of 16 served requests ran eager), a request that ends while others run does
not turn the others' graphs off, and a request admitted eager keeps the batch eager."""

from types import SimpleNamespace

import torch
from conftest import random_model
from test_idle_pool import DUAL, _graph_engine

from mosaic import MosaicEngine
from mosaic.engine import batch_memory as BM
from mosaic.engine.scheduler import Scheduler
from mosaic.memory.caching import segment_bytes
from mosaic.policy import graph_charge as GC
from mosaic.policy.graph_charge import GraphCharge


def test_a_budgeted_batch_captures_its_stacked_steps_and_replays_them():
    model = random_model("llada")
    prompts = [[3, 4, 5], [6, 7, 8], [9, 10, 11], [3, 5, 7]]
    ref = MosaicEngine(model, {"progress": False}).generate(prompts, **DUAL)
    eng, graphs = _graph_engine(model, guard=True)
    first = eng.generate(prompts, **DUAL)
    captures = graphs.stats.captures
    second = eng.generate(prompts, **DUAL)
    assert torch.equal(first.tokens, ref.tokens) and torch.equal(second.tokens, ref.tokens)
    assert graphs.stats.failures == [] and captures > 0
    assert graphs.stats.captures == captures and graphs.stats.replays > 0        # the second only replays
    assert eng.guard.backend.limit is None and not eng.memory.in_request


def test_a_request_that_ends_first_leaves_the_others_captured(monkeypatch):
    """Two requests of different canvases: the short one ends while the long one runs; the
    long one's remaining steps are still replayed (end() while another is in flight changes
    nothing; the batch of one left keeps the charge it had)."""
    model = random_model("llada")
    eng, graphs = _graph_engine(model, guard=True)
    short, long_ = dict(DUAL), dict(DUAL, max_new_tokens=16, steps=16)
    seen = []
    real = eng.memory.end

    def end(owner=None):
        real(owner)
        seen.append((eng.memory.in_request, eng.memory.captured))
    monkeypatch.setattr(eng.memory, "end", end)
    for _ in range(2):           # the first batch captures, the second replays
        sched = Scheduler(eng)
        for o in (short, long_):
            sched.add(eng.start(eng.request([3, 4, 5], **o)))
        assert all(f.error is None for f in sched.run_all())
    assert (True, True) in seen                     # the short one ended: the long one still captured
    assert seen[-1] == (False, False) and eng.guard.backend.limit is None
    assert graphs.stats.failures == []


def test_one_request_admitted_eager_keeps_the_batch_eager():
    model = random_model("llada")
    eng, graphs = _graph_engine(model, guard=True)
    eng.generate([[3, 4, 5], [6, 7, 8]], **DUAL)                   # graphs held
    assert len(graphs.graphs) > 0
    runs = [SimpleNamespace(request=SimpleNamespace(native=False, batch=1, length=11, grammar=None,
                                                    gen=eng.generation_config(**DUAL)),
                            admission=SimpleNamespace(captured=c)) for c in (True, False)]
    eng.memory.begin(eng.admit(1, 11, eng.generation_config(**DUAL)), owner=runs[0])   # a request in flight
    assert eng.memory.captured and len(graphs.graphs) > 0
    BM.hold_graphs(eng, runs)
    assert not eng.memory.captured and len(graphs.graphs) == 0
    eng.memory.end(owner=runs[0])


def test_requests_in_flight_are_counted_by_their_runs():
    eng = MosaicEngine(random_model("llada"), {"progress": False, "memory_budget": "1GiB"})
    adm = eng.admit(1, 11, eng.generation_config(**DUAL))
    a, b = object(), object()
    eng.memory.begin(adm, owner=a)
    eng.memory.begin(adm, owner=b)                  # joins: the batch's mode is the Scheduler's
    eng.memory.end(owner=a)
    assert eng.memory.in_request
    eng.memory.end(owner=object())                  # a run that never began (native): nothing changes
    assert eng.memory.in_request
    eng.memory.end(owner=b)
    assert not eng.memory.in_request and not eng.memory.owners


def test_the_batch_charge_holds_the_stacked_steps_inputs():
    """Admitter.batch_graphs charges a stacked step of 16 rows a graph's input set per graph."""
    eng = MosaicEngine(random_model("llada"), {"progress": False, "memory_budget": "1GiB"})
    _, graphs = _graph_engine(random_model("llada"), guard=False)
    eng.admitter.graphs = graphs
    gen = eng.generation_config(**DUAL)
    one, spare1 = eng.admitter.batch_graphs(1, 11, gen)
    many, spare16 = eng.admitter.batch_graphs(16, 11, gen)
    assert one.captured and many.captured and isinstance(many, GraphCharge)
    assert spare16 < spare1
    # each of the batch's graphs has its own input set (a shape per bucket, fill, refill)
    assert many.inputs_bytes == GC.GRAPHS_WANTED * segment_bytes(1)


def test_a_request_alone_between_batches_keeps_the_batchs_graphs():
    """A lull (a batch ends, one request runs alone, a batch forms again): the lone request's
    charge holds the batch's graphs too, so the next batch only replays (under one request's
    charge of three input sets they were evicted and captured again at every lull)."""
    model = random_model("llada")
    eng, graphs = _graph_engine(model, guard=True)
    prompts = [[3, 4, 5], [6, 7, 8]]
    eng.generate(prompts, **DUAL)
    eng.generate([3, 4, 5], **DUAL)
    again = eng.generate(prompts, **DUAL)
    assert again.stats["graphs"]["captures"] == 0 and graphs.stats.evicted == 0, graphs.stats.as_dict()
