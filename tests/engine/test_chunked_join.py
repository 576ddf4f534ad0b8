"""Chunked joining (engine/scheduler.py, engine/fills.py, models/fill_slices.py): a block cache's
fill runs in slices of layers that ride along with the running requests' steps under the
round's token budget; the slices compute the unchunked fill's K/V and outputs, so the tokens are
the same (CPU, float32)."""

from types import SimpleNamespace

import pytest
import torch
from conftest import random_model
from test_scheduler import FakeExecutor, FakeRun

from mosaic import MosaicEngine
from mosaic.engine import scheduler as S
from mosaic.engine.scheduler import Scheduler

LAYERS = 8


class FakeFill(FakeRun):
    """A run whose first call is a fill of `tokens` tokens, then `steps - 1` block steps."""

    def __init__(self, name, tokens, **kw):
        super().__init__(name, **kw)
        self.tokens, self.layers_run = tokens, []

    @property
    def filling(self):
        return self.started and self.steps_done == 0


class SliceExecutor(FakeExecutor):
    def run_round(self, work):
        self.rounds.append([(w.run.name, w.layers) for w in work])
        out = []
        for w in work:
            r = w.run
            if w.layers is not None:
                r.layers_run.append(w.layers)
                out.append(None if w.layers[1] < LAYERS else ("out", r.name, r.steps_done))
            else:
                if getattr(r, "filling", False):
                    r.layers_run.append((0, LAYERS))
                out.append(("out", r.name, r.steps_done))
        return out


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(S, "can_slice", lambda engine, run: getattr(run, "filling", False))
    monkeypatch.setattr(S, "fill_tokens", lambda run: run.tokens)
    monkeypatch.setattr(S, "_tokens", lambda run: 32 * run.request.batch)     # a block step: 32 rows

    def make(round_tokens):
        engine = SimpleNamespace(memory=SimpleNamespace(has_budget=False),
                                 model=SimpleNamespace(cfg=SimpleNamespace(num_layers=LAYERS)))
        return Scheduler(engine, round_tokens=round_tokens, executor=SliceExecutor())
    return make


def test_a_fill_alone_runs_whole(fake):
    s = fake(round_tokens=64)
    f = FakeFill("f", tokens=1024, steps=3)
    s.add(f)
    s.run_all()
    assert f.layers_run == [(0, LAYERS)] and s.executor.rounds[0] == [("f", None)]


def test_a_joining_fill_rides_along_in_slices_and_nobody_waits_for_it(fake):
    s = fake(round_tokens=512)
    decoders = [FakeRun(f"d{i}", steps=20) for i in range(4)]          # 4 x 32 = 128 tokens a round
    for d in decoders:
        s.add(d)
    s.step()
    f = FakeFill("f", tokens=1024, steps=2)
    s.add(f)
    while f.steps_done == 0:
        s.step()
        assert all(any(name == d.name for name, _ in s.executor.rounds[-1]) for d in decoders)   # every round
    # 512 - 128 = 384 tokens a round = 3 of 8 layers of a 1,024-token fill: [0, 3), [3, 6), [6, 8)
    assert f.layers_run == [(0, 3), (3, 6), (6, 8)]
    assert f.steps_done == 1 and not s.fill_done


def test_every_fill_advances_even_when_the_others_use_the_whole_budget(fake):
    s = fake(round_tokens=128)
    for i in range(8):                       # 8 x 32 = 256 tokens: over the budget by themselves
        s.add(FakeRun(f"d{i}", steps=30))
    s.step()
    f, g = FakeFill("f", tokens=1024, steps=2), FakeFill("g", tokens=1024, steps=2)
    s.add(f)
    s.add(g)
    for _ in range(3):
        s.step()
    # each fill gets half the budget, 64 tokens = half a layer, so one layer a round: neither
    # waits for the other (a request whose fill waited would not run at all)
    assert f.layers_run == [(0, 1), (1, 2), (2, 3)] and g.layers_run == [(0, 1), (1, 2), (2, 3)]


def test_slices_cover_every_layer_once_and_a_second_fill_uses_what_is_left(fake):
    s = fake(round_tokens=1024)
    s.add(FakeRun("d", steps=40))
    s.step()
    f, g = FakeFill("f", tokens=2048, steps=2), FakeFill("g", tokens=512, steps=2)
    s.add(f)
    s.add(g)
    s.run_all()
    for fill in (f, g):
        cover = [i for a, b in fill.layers_run for i in range(a, b)]
        assert cover == list(range(LAYERS)), fill.layers_run
    # round 1: 992 left; f takes 3 layers (768 tokens); 224 are left, below g's floor of 512 =
    # 8 of its 64-token layers: g runs whole
    assert f.layers_run[0] == (0, 3) and g.layers_run[0] == (0, LAYERS)


def test_a_run_cancelled_in_the_middle_of_its_fill_leaves_and_is_dropped(fake):
    s = fake(round_tokens=256)
    s.add(FakeRun("d", steps=30))
    s.step()
    f = FakeFill("f", tokens=2048, steps=2)
    s.add(f)
    s.step()
    assert f.layers_run and id(f) in s.fill_done
    s.cancel(f)
    ended = s.step()
    assert [x.run.name for x in ended] == ["f"] and "f" in s.executor.dropped and id(f) not in s.fill_done


def test_round_tokens_must_be_positive():
    with pytest.raises(ValueError, match="round_tokens"):
        Scheduler(SimpleNamespace(), round_tokens=0)


def test_the_flags_help_names_the_servers_round_budget():
    from mosaic.cli_options import ENGINE_FLAGS
    from mosaic.serve.commands import SERVE_ROUND_TOKENS
    assert f"mosaic serve: {SERVE_ROUND_TOKENS} unless given" in ENGINE_FLAGS["--round-tokens"][3]


# -- the real thing: the same K/V and tokens with and without slicing

def _engine(family, layers=4):
    return MosaicEngine(random_model(family, num_layers=layers), {"progress": False})


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_a_fill_in_slices_writes_the_unchunked_fills_kv_and_outputs(family):
    eng = _engine(family)
    opts = dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.9)
    whole, sliced = (eng.start(eng.request([3, 4, 5, 6, 7, 8, 9], **opts)) for _ in range(2))
    whole.start()
    sliced.start()
    want = whole.execute_pending()
    fills = eng_fills(eng)
    outs = [fills.run(sliced, a, b) for a, b in ((0, 1), (1, 3), (3, 4))]
    assert outs[0] is None and outs[1] is None and not fills.residuals
    for k in want:
        assert torch.equal(outs[2][k], want[k]), k
    for layer in range(eng.model.cfg.num_layers):     # every layer's K and V, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(sliced.state.store.acquire(layer),
                                                     whole.state.store.acquire(layer))), layer
    whole.close()
    sliced.close()


def eng_fills(eng):
    from mosaic.engine.fills import FillSlices
    return FillSlices(eng)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_tokens_are_the_same_with_and_without_chunked_joining(family):
    eng = _engine(family)
    dual = dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.9)
    cases = [([3, 4, 5, 6], dual), (list(range(3, 30)), dual), ([5, 6, 7], dict(dual, cache="prefix")),
             (list(range(4, 20)), dict(dual, threshold=0.5))]
    alone = [eng.generate(p, **o).tokens for p, o in cases]
    sched = Scheduler(eng, round_tokens=16)     # far less than a fill: every joining fill is sliced
    runs = [eng.start(eng.request(p, **o)) for p, o in cases]
    sched.add(runs[0])
    for run in runs[1:]:
        sched.step()
        sched.step()
        sched.add(run)
    ended = sched.run_all()
    assert all(f.error is None for f in ended)
    assert sched.stats.fill_slices > 0
    for run, want in zip(runs, alone):
        assert torch.equal(run.result().tokens, want)
