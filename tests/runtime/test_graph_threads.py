"""Captured steps and threads (runtime/graphs.py): a shape is captured only on a thread that ran
it eagerly first, since libraries make per-thread state (cuBLAS/cuBLASLt handles and
workspaces, cuDNN's handle) on a thread's first use, and made inside a capture it invalidates
the capture. A server's engine thread is not the thread that warmed the engine up: on the H200
the served request's captures failed and the request ran eager at 0.20x generate()
(bench/results/gpu/session7/everyday_2a23023.log). And a failed capture gives up the pool it
recorded into, so that later captures work."""

import threading

import torch
from conftest import random_model
from fake_graphs import CapturingGraphs

from mosaic import MosaicEngine
from mosaic.runtime.graphs import StepGraphs


class PerThreadGraphs(CapturingGraphs):
    """A fake whose capture fails, as CUDA's does, on a thread that has run no eager step yet
    (its library handles would be made inside the capture)."""

    def __init__(self):
        super().__init__()
        self.warm, self.threads = set(), []

    def capture(self, fn, pool=None, draws=False):
        if threading.get_ident() not in self.warm:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        self.threads.append(threading.get_ident())
        return super().capture(fn, pool, draws)


def _engine(model, backend):
    eng = MosaicEngine(model, {"progress": False})
    eng.use_graphs(StepGraphs(backend, vocab=model.cfg.vocab, dtype=model.dtype))
    launch = eng.runner.launch

    def recording(*args, **kw):       # an eager step warms its thread's (fake) libraries
        if not backend.inside:
            backend.warm.add(threading.get_ident())
        return launch(*args, **kw)
    eng.runner.launch = recording
    return eng


def _on_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_a_shape_seen_on_another_thread_runs_eagerly_once_before_its_capture():
    model = random_model("llada")
    opts = dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.9)
    want = MosaicEngine(model, {"progress": False}).generate([3, 4, 5], **opts)
    backend = PerThreadGraphs()
    eng = _engine(model, backend)
    for _ in range(2):                              # the main thread: its captures, its replays
        assert torch.equal(eng.generate([3, 4, 5], **opts).tokens, want.tokens)
    st = eng.graphs.stats
    captures, replays = st.captures, st.replays
    assert captures > 0 and not st.failures
    eng.graphs.drop_graphs()     # what the server's thread meets: new keys (a store elsewhere) of seen shapes

    def served():
        return eng.generate([3, 4, 5], **opts), eng.generate([3, 4, 5], **opts)
    first, second = _on_thread(served)
    assert torch.equal(first.tokens, want.tokens) and torch.equal(second.tokens, want.tokens)
    assert not st.failures, st.failures
    assert st.captures > captures and st.replays > replays
    assert set(backend.threads[-(st.captures - captures):]) != {threading.get_ident()}   # captured there
    assert second.stats["graphs"]["mode"] == "captured" and second.stats["graphs"]["captures"] == 0
    assert second.stats["graphs"]["eager"] == 0 and second.stats["graphs"]["replays"] > 0
