"""One answer to "what fits": the refusal's "longest that fits" for a request of
`mosaic plan`'s shape is the L_max that `mosaic plan` prints for the same model, budget and device
(both are policy/admitter.Admitter.longest over the same grid)."""

import json

import pytest

from mosaic import MemoryBudgetError, MosaicEngine
from mosaic.cli import main


def test_the_refusal_names_the_l_max_mosaic_plan_prints(capsys):
    assert main(["plan", "--model", "tiny-llada", "--budget", "0.4GiB", "--device", "cpu", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    l_max, prompt_ratio = rep["l_max"], rep["prompt_ratio"]
    eng = MosaicEngine("tiny-llada", {"progress": False, "memory_budget": "0.4GiB"})
    for n in (l_max + 1024, 2 * l_max):              # plan's shape: a canvas of (1 - prompt_ratio) * n
        gen = eng.generation_config(max_new_tokens=round((1 - prompt_ratio) * n), steps=1)
        with pytest.raises(MemoryBudgetError, match=f"longest that fits: {l_max:,} tokens") as err:
            eng.admit(1, n, gen)
        assert err.value.max_tokens == l_max
    gen = eng.generation_config(max_new_tokens=round((1 - prompt_ratio) * l_max), steps=1)
    assert eng.admit(1, l_max, gen) is not None       # and L_max itself is admitted
    eng.close()


def test_a_request_far_over_the_budget_still_names_what_fits():
    # a 15-token prompt and 10M / 1G new tokens: the shape kept its prompt at every length only
    # once the canvas was capped at n - 1 (it said "longest that fits: 0 tokens")
    eng = MosaicEngine("tiny-llada", {"progress": False, "memory_budget": "4GiB"})
    named = set()
    for n in (10_000_000, 1_000_000_000):
        with pytest.raises(MemoryBudgetError) as err:
            eng.admit(1, n + 15, eng.generation_config(max_new_tokens=n, steps=1))
        named.add(err.value.max_tokens)
    assert len(named) == 1 and named.pop() > 1_000_000
    eng.close()


def test_capacity_is_not_capped_at_two_million_tokens():
    eng = MosaicEngine("tiny-llada", {"progress": False, "memory_budget": "8GiB"})
    cap = eng.capacity()
    assert cap > 1 << 21                    # the search's old ceiling
    with pytest.raises(MemoryBudgetError):
        eng.admit(1, cap + 1, eng.generation_config(max_new_tokens=cap, steps=1))
    eng.close()
