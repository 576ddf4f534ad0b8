"""An engine gives back what it took (issue 31): the weights it loaded go with close() (not at
the next cyclic collection), and a closed, dropped engine leaves no object alive."""

import gc
import weakref

from conftest import random_model

from mosaic import MosaicEngine


def test_a_dropped_engine_is_freed_without_the_cyclic_collector():
    gc.collect()
    gc.disable()
    try:
        eng = MosaicEngine("tiny-llada", {"progress": False, "device": "cpu"})
        eng.generate("sort 907=", max_new_tokens=4, steps=4)
        alive = [weakref.ref(o) for o in (eng, eng.model, eng.memory, eng.runner, eng.admitter, eng.executor)]
        del eng
        assert all(r() is None for r in alive), [type(r()).__name__ for r in alive if r() is not None]
    finally:
        gc.enable()


def test_close_releases_the_weights_it_loaded_but_not_a_callers_model():
    eng = MosaicEngine("tiny-llada", {"progress": False, "device": "cpu"})
    model = eng.model
    eng.close()
    assert model.weight_bytes() == 0 and not model.layers
    mine = random_model("llada")
    held = mine.weight_bytes()
    other = MosaicEngine(mine, {"progress": False})
    other.generate([3, 4, 5], max_new_tokens=4, steps=4)
    other.close()
    assert mine.weight_bytes() == held          # the caller's model is the caller's


def test_history_is_bounded():
    eng = MosaicEngine(random_model("llada"), {"progress": False})
    keep = eng.preparer.history_keep = 8
    for _ in range(30):
        eng.generate([3, 4, 5], max_new_tokens=2, steps=2)
    assert len(eng.history) == keep
