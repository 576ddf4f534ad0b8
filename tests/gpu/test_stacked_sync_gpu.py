"""On the GPU a stacked round never waits for the device (engine/batching.py): with ~0.1 s of
device work queued before each round (torch.cuda._sleep), the stream is still busy when the
round has launched its stacked step and every run has read its readback, committed and launched
its next step (dual cache, threshold, run ahead, captured), except in rounds where a run ended
(its result is read back) and the few rounds where a join or a fill reads its candidates
(at most 10%). And host-known integers reach the device queued behind that work
(kernels/host_ints.py). Skipped without CUDA."""

import pytest
import torch
from conftest import needs_cuda

import mosaic.runtime.samplers.fast_llada as F
from mosaic import MosaicEngine, load
from mosaic.engine.batching import RoundExecutor
from mosaic.engine.scheduler import Scheduler
from mosaic.kernels.host_ints import ints_on

pytestmark = [pytest.mark.gpu, needs_cuda]

SLEEP = int(2e8)      # GPU cycles: ~0.1 s at ~2 GHz, far more than a round's host work


def test_host_ints_queue_behind_the_device():
    torch.cuda._sleep(SLEEP)
    t = ints_on(list(range(1000)), "cuda")
    rows = ints_on(torch.arange(7), "cuda", torch.int32)
    assert not torch.cuda.current_stream().query()        # the host did not wait for the sleep
    assert t.tolist() == list(range(1000)) and rows.dtype == torch.int32 and rows.tolist() == list(range(7))


def test_a_stacked_round_leaves_the_device_busy(monkeypatch):
    monkeypatch.setattr(F, "RUN_AHEAD", True)
    model = load("llada-8b", device="cuda", num_layers=2)
    eng = MosaicEngine(model, {"progress": False})
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.mask_id - 4, (200 + 8 * i,), generator=g).tolist() for i in range(4)]
    kw = dict(max_new_tokens=64, steps=64, block_length=32, cache="dual", threshold=0.9)
    eng.generate(prompts, **kw)                     # every shape run eagerly once, then captured
    want = eng.generate(prompts, **kw)
    rounds = []
    real_round, real_update = RoundExecutor.run_round, Scheduler._update

    def run_round(self, work):
        torch.cuda._sleep(SLEEP)
        return real_round(self, work)

    def update(self, work, outcomes):
        done = real_update(self, work, outcomes)
        rounds.append((not torch.cuda.current_stream().query(), bool(done)))
        return done
    monkeypatch.setattr(RoundExecutor, "run_round", run_round)
    monkeypatch.setattr(Scheduler, "_update", update)
    got = eng.generate(prompts, **kw)
    assert torch.equal(got.tokens, want.tokens)
    kept = [busy for busy, ended in rounds if not ended]
    idle = [i for i, busy in enumerate(kept) if not busy]
    # the H200 at 6bad699: 63 rounds, some idle (which ones was not printed): a join's start
    # reads its prompt's masks and a fill whose candidates leave its block reads them (nonzero);
    # the bound holds the rest (a block step per round) to never waiting
    assert len(kept) > 4 and len(idle) <= 0.1 * len(kept), (idle, len(kept))
