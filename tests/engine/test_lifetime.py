"""An engine gives back what it took: the weights it loaded go with close() (not at
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


def test_a_budget_the_weights_cannot_fit_is_refused_before_they_load(monkeypatch):
    """The budget check comes before any weight is allocated (from the preset table or
    config.json): a bundled model and a preset whose weights exceed the budget never reach the
    loader's allocation."""
    import pytest

    from mosaic import MemoryBudgetError, loader

    def no_allocation(*a, **k):
        raise AssertionError("the weights were allocated before the budget was checked")
    monkeypatch.setattr(loader, "allocate", no_allocation)
    with pytest.raises(MemoryBudgetError, match="refused before loading them"):
        MosaicEngine("tiny-llada", {"progress": False, "device": "cpu", "memory_budget": "64MiB"})
    with pytest.raises(MemoryBudgetError, match="llada-8b.*refused before loading them") as err:
        MosaicEngine("llada-8b", {"progress": False, "device": "cpu", "dtype": "bfloat16", "memory_budget": "8GiB"})
    assert err.value.needed_bytes > 15 * 2**30 and err.value.max_tokens == 0


def test_a_closed_engine_says_so():
    """generate() after close() (or a `with` block) is one clear error, not an IndexError from the
    graph layer; so are admit(), step() and capacity()."""
    import pytest
    import torch

    from mosaic.errors import InputError
    with MosaicEngine("tiny-llada", {"progress": False, "device": "cpu"}) as eng:
        eng.generate("sort 907=", max_new_tokens=4, steps=4)
    for call in (lambda: eng.generate("sort 907=", max_new_tokens=4, steps=4),
                 lambda: eng.admit(1, 8, eng.generation_config(max_new_tokens=4)),
                 lambda: eng.step(torch.tensor([[3, 4, 5]]))):
        with pytest.raises(InputError, match="this engine is closed"):
            call()
    eng.close()                                  # twice is harmless
