"""One answer to "what fits" (issue 31 item 2): the refusal's "longest that fits" for a request of
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
