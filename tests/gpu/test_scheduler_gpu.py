"""The Scheduler on the GPU: chunked joining gives the unchunked fills' tokens (the slices run the
same ops on the same shapes, eager where a whole fill may be captured), and requests that join a
running batch keep their tokens in batch-invariant mode. Skipped without CUDA.

    python -m pytest -q -m gpu tests/gpu/test_scheduler_gpu.py"""

import pytest
import torch
from conftest import needs_cuda

from mosaic import MosaicEngine, load
from mosaic.engine.scheduler import Scheduler

pytestmark = [pytest.mark.gpu, needs_cuda]

DUAL = dict(max_new_tokens=32, steps=32, block_length=16, cache="dual", threshold=0.9)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]


def _schedule(eng, cases, round_tokens):
    """The same join schedule (each request three rounds after the one before) at a round budget."""
    sched = Scheduler(eng, round_tokens=round_tokens)
    runs = [eng.start(eng.request(p, **o)) for p, o in cases]
    sched.add(runs[0])
    for run in runs[1:]:
        for _ in range(3):
            sched.step()
        sched.add(run)
    assert all(f.error is None for f in sched.run_all())
    return [run.result().tokens for run in runs], sched.stats.fill_slices


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
def test_chunked_joining_keeps_the_tokens_on_the_gpu(invariant):
    """Sliced fills vs whole fills under the same schedule: the same tokens (the slices are the
    fill's own ops at its own shapes); in batch-invariant mode also each request's tokens alone."""
    eng = MosaicEngine(load("llada-8b", device="cuda", num_layers=4),
                       {"progress": False, "batch_invariant": invariant})
    cases = [(p, dict(DUAL, threshold=t)) for p, t in zip(_prompts((200, 700, 90)), (0.9, 0.7, 0.9))]
    whole, none = _schedule(eng, cases, None)
    sliced, slices = _schedule(eng, cases, 64)       # every joining fill is sliced
    assert none == 0 and slices > 0
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced))
    if invariant:
        alone = [eng.generate(p, **o).tokens for p, o in cases]
        assert all(torch.equal(a, b) for a, b in zip(alone, sliced))
