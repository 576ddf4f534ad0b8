"""The worker's canvas reads one step late (serve/canvas_reader.py, as on CUDA) give the same
streamed text, answer and finish as immediate reads, with and without a stop string (CPU)."""

import functools
import threading

import pytest
import torch

from mosaic import MosaicEngine
from mosaic.serve import worker as W
from mosaic.serve.canvas_reader import CanvasReader


def test_reader_hands_back_the_previous_step():
    r = CanvasReader(2, lag=True)
    canvases = [torch.tensor([[7, 8, i, i + 1]]) for i in range(3)]
    assert r.push(0, canvases[0]) is None
    got = [r.push(i, c) for i, c in enumerate(canvases[1:], 1)] + [r.flush()]
    assert [(i, ids.tolist()) for i, ids in got] == [(0, [0, 1]), (1, [1, 2]), (2, [2, 3])]
    assert r.flush() is None
    assert CanvasReader(1).push(4, canvases[2])[1].tolist() == [8, 2, 3]     # CPU: at once


def _serve(eng, prompt, gen, stop):
    events, ev = [], threading.Event()

    def emit(kind, payload):
        events.append((kind, payload))
        if kind in ("done", "error"):
            ev.set()
    worker = W.EngineWorker(eng, max_batch=1)
    worker.submit(W.Job(eng.encode(prompt)[0], gen, emit, stop=stop))
    assert ev.wait(120)
    worker.close()
    kind, res = events[-1]
    assert kind == "done", res
    deltas = "".join(p.delta for k, p in events if k == "step")
    return res, deltas


@pytest.mark.parametrize("stop", [[], ["3"]])
def test_a_lagged_reader_streams_the_same_answer(monkeypatch, stop):
    eng = MosaicEngine("tiny-llada", {"device": "cpu", "progress": False})
    gen = eng.generation_config(max_new_tokens=16, steps=16)
    want, want_deltas = _serve(eng, "sort 31415926=", gen, stop)
    monkeypatch.setattr(W, "CanvasReader", functools.partial(CanvasReader, lag=True))
    got, deltas = _serve(eng, "sort 31415926=", gen, stop)
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert deltas == want_deltas
    assert got.steps_run >= want.steps_run


def test_chat_answers_the_same_with_a_lagged_reader(monkeypatch):
    import io

    from mosaic.serve import chat as C
    eng = MosaicEngine("tiny-llada", {"device": "cpu", "progress": False})
    gen = eng.generation_config(max_new_tokens=16, steps=16)

    def answer():
        out, err = io.StringIO(), io.StringIO()
        msgs = [{"role": "user", "content": "sort 31415926="}]
        return C._answer(eng, gen, msgs, None, True, out, err), out.getvalue()
    want = answer()
    monkeypatch.setattr(C, "CanvasReader", functools.partial(CanvasReader, lag=True))
    assert answer() == want and want[0]
