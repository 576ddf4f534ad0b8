"""The server's worker runs concurrent requests as one continuous batch: they share
steps, and each gets the tokens it gets alone (CPU, float32)."""

import threading

from mosaic import MosaicEngine
from mosaic.serve.worker import EngineWorker, Job


def _collect():
    done, ev = {}, threading.Event()

    def emit_for(key, expect):
        def emit(kind, payload):
            if kind in ("done", "error"):
                done[key] = (kind, payload)
                if len(done) == expect:
                    ev.set()
        return emit
    return done, ev, emit_for


def test_concurrent_jobs_share_steps_and_keep_their_tokens():
    eng = MosaicEngine("tiny-llada", {"device": "cpu", "progress": False})
    prompts = ["sort 907=", "sort 31415926=", "sort 5555=", "sort 12="]
    gens = [eng.generation_config(max_new_tokens=8, steps=8) for _ in prompts]
    alone = [eng.generate(p, config=g).tokens[0].tolist() for p, g in zip(prompts, gens)]
    done, ev, emit_for = _collect()
    worker = EngineWorker(eng, max_batch=8)
    jobs = [Job(eng.encode(p)[0], g, emit_for(i, len(prompts)), want_steps=False)
            for i, (p, g) in enumerate(zip(prompts, gens))]
    for j in jobs:            # queued together: they join the batch at once
        assert worker.submit(j)
    assert ev.wait(120)
    worker.close()
    for i, want in enumerate(alone):
        kind, res = done[i]
        assert kind == "done", res
        assert res.token_ids == [t for t in want if t != eng.model.cfg.eos_id][:len(res.token_ids)]
        assert res.text == eng.decode(want)
    assert worker.scheduler.stats.stacked_steps > 0


def test_max_batch_one_runs_requests_one_at_a_time():
    eng = MosaicEngine("tiny-llada", {"device": "cpu", "progress": False})
    gen = eng.generation_config(max_new_tokens=8, steps=8)
    done, ev, emit_for = _collect()
    worker = EngineWorker(eng, max_batch=1)
    for i, p in enumerate(["sort 907=", "sort 12="]):
        worker.submit(Job(eng.encode(p)[0], gen, emit_for(i, 2), want_steps=False))
    assert ev.wait(120)
    worker.close()
    assert all(k == "done" for k, _ in done.values()) and worker.scheduler.stats.stacked_steps == 0
