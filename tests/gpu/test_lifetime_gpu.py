"""The budget is the process's: five engines created, used, closed and dropped one
after another in one process, at different budgets, with the cyclic garbage collector off. The
driver's counter never passes an engine's budget while it runs, and after each close + del the
device is back at the baseline (nothing held until gc.collect): the level after the first engine,
since the libraries' code and handles the first one loaded (cuBLAS, cuDNN, Triton modules: the
process's context, ~190 MiB on the H200) stay for the process's life. A second live engine admits
against what the first holds. Skipped without CUDA."""

import gc
import json
import os

import pytest
import torch
from conftest import needs_cuda

from mosaic import MemoryBudgetError, MosaicEngine
from mosaic.memory.device_meter import DeviceMeter

pytestmark = [pytest.mark.gpu, needs_cuda]
GiB = 2**30
SLACK = 64 * 2**20     # the CUDA context's own growth (kernel modules loaded late)


def _used() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_five_engines_in_one_process_hold_nothing_after_close():
    torch.cuda.init()
    torch.ones(1, device="cuda")            # the context exists before the baseline
    gc.collect()
    torch.cuda.empty_cache()
    gc.disable()
    rows = []
    try:
        base = None
        start = _used()
        for budget in (20, 26, 22, 32, 24):      # llada-8b holds 15.9 GiB before any token
            eng = MosaicEngine("llada-8b", {"progress": False, "memory_budget": f"{budget}GiB", "dtype": "bfloat16"})
            with DeviceMeter(interval_s=0.002) as meter:
                out = eng.generate(list(range(5, 1005)), max_new_tokens=64, block_length=32, steps=8)
            peak = meter.peak_bytes
            eng.close()
            del eng, out
            after = _used()
            base = after if base is None else base       # the libraries loaded by the first engine stay
            rows.append({"budget_gib": budget, "peak_bytes": peak, "baseline_bytes": base, "after_bytes": after,
                         "before_first_bytes": start})
            assert peak <= budget * GiB, rows[-1]
            assert after - base <= SLACK, rows[-1]
    finally:
        gc.enable()
        out_dir = os.environ.get("OUT")
        if out_dir:
            with open(os.path.join(out_dir, "engine_lifetime.json"), "w") as f:
                json.dump(rows, f, indent=1)


def test_a_second_live_engine_admits_against_what_the_first_holds():
    """...and is refused before it allocates a byte: the check of its weights against the budget
    and what the first engine holds comes before they are built (the driver's counter reached
    31.0 GiB under a 24 GiB budget when it came after)."""
    gc.collect()
    torch.cuda.empty_cache()
    first = MosaicEngine("llada-8b", {"progress": False, "dtype": "bfloat16"})     # ~16 GB of weights
    torch.cuda.synchronize()
    before = _used()
    torch.cuda.reset_peak_memory_stats()
    allocated = torch.cuda.max_memory_allocated()
    with pytest.raises(MemoryBudgetError, match="held by other engines of this process.*refused before loading"):
        MosaicEngine("llada-8b", {"progress": False, "dtype": "bfloat16", "memory_budget": "24GiB"})
    assert torch.cuda.max_memory_allocated() - allocated <= 2**20
    assert _used() - before <= SLACK
    first.close()
