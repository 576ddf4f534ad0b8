"""Offload and FP8 next to the features they were merged with: Fast-dLLM block caches (the K/V
store's tiers), the budget guard, capacity with a block cache, the plan command, and sequence
parallelism."""

import dataclasses
import json

import pytest
import torch
from conftest import random_model
from ranks import run, single

from mosaic import InputError, MemoryBudgetError, MosaicEngine
from mosaic.cli import main as cli_main
from mosaic.config import EngineConfig
from mosaic.engine import warmup
from mosaic.memory.accounting import FIXED_BYTES
from mosaic.memory.transient import SimBackend
from mosaic.policy.capacity import capacity_report
from mosaic.policy.offload import offload_of

CACHED = dict(max_new_tokens=8, steps=8, block_length=4, threshold=0.2)


def engine(model, **cfg):
    return MosaicEngine(model, {"sanitize": True, "progress": False, **cfg})


def prompt(cfg, n=6):
    return torch.randint(0, cfg.mask_id - 4, (n,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("tier", ["device", "host"])
def test_block_cache_with_offloaded_weights_keeps_tokens(cache, tier):
    model = random_model("llada", num_layers=4)
    p = prompt(model.cfg)
    ref = engine(model, kv_tier=tier).generate(p, cache=cache, **CACHED)
    out = engine(model, kv_tier=tier, offload="weights", prefetch_layers=2).generate(p, cache=cache, **CACHED)
    assert torch.equal(out.tokens, ref.tokens) and out.stats["nfe"] == ref.stats["nfe"]
    assert out.offload == "weights" and ref.offload == "resident" and out.stats["kv_tier"] == tier


def test_block_cache_and_fp8_layers_offloaded_or_not():
    model = random_model("llada", num_layers=4)
    p = prompt(model.cfg)
    fp8 = {"precision": [{"layers": [1, 2], "dtype": "fp8"}]}
    ref = engine(model, **fp8).generate(p, cache="dual", **CACHED)
    out = engine(random_model("llada", num_layers=4), offload="weights", **fp8).generate(p, cache="dual", **CACHED)
    assert torch.equal(out.tokens, ref.tokens)
    assert any("FP8 weights in layers 1-2" in lab for lab in out.lossy) and out.precision[1] == "fp8"


def test_streamed_kv_and_a_block_cache_do_not_combine():
    model = random_model("llada", num_layers=2)
    with pytest.raises(InputError, match="keeps its K/V in its own store"):
        engine(model, offload="weights+kv").generate(prompt(model.cfg), cache="prefix", **CACHED)
    # auto never streams a cached request's K/V; without a budget it stays resident
    out = engine(model, offload="auto").generate(prompt(model.cfg), cache="prefix", **CACHED)
    assert out.offload == "resident"


def test_auto_offloads_a_cached_request_when_resident_does_not_fit():
    model = random_model("llada", hidden=128, ffn=512, num_layers=6, num_heads=4, num_kv_heads=4, head_dim=32)
    p = prompt(model.cfg)
    gen = dict(cache="dual", **CACHED)
    free = engine(model, kv_tier="device", offload="weights")
    ref = free.generate(p, **gen)
    budget = ref.predicted_bytes                            # what the weights mode needs
    with pytest.raises(MemoryBudgetError):
        engine(model, kv_tier="device", memory_budget=budget).generate(p, **gen)
    auto = engine(model, kv_tier="device", offload="auto", memory_budget=budget)
    out = auto.generate(p, **gen)
    assert out.offload == "weights" and torch.equal(out.tokens, ref.tokens)
    assert out.predicted_bytes <= budget


def test_the_guard_charges_phantom_layers_only_while_resident():
    """A depth-truncated model charged its full depth: the guard's cap counts the missing layers
    for resident requests (admission charges them) and not for offloaded ones (it does not)."""
    model = random_model("llada", num_layers=2)
    model.charged_layers = 6
    phantom = warmup.phantom_weight_bytes(model)
    eng = engine(model, offload="auto", memory_budget="1GiB")
    rep = {"workspace_bytes": 0, "workspace_torch_bytes": 0, "workspace_driver_bytes": 0}
    eng.memory.use_guard(warmup.make_guard(eng.model, eng.budget, rep, SimBackend()))
    eng.memory._guard_phantom = phantom
    base = eng.guard.outside_bytes - phantom
    gen = eng.generation_config(max_new_tokens=4)
    resident = eng.admit(1, 8, gen)
    eng.memory.begin(resident)
    assert eng.guard.outside_bytes == base + phantom
    eng.memory.end()
    # resident no longer fits: auto admits the request with its layers offloaded
    eng.memory.budget = dataclasses.replace(eng.budget, budget_bytes=eng.budget.fixed_bytes + 1)
    adm = eng.admit(1, 8, gen)
    assert adm.prepared.step.offload is not None
    eng.memory.begin(adm)
    assert eng.guard.outside_bytes == base
    eng.memory.end()


def test_capacity_with_a_block_cache_and_offloaded_weights():
    model = random_model("llada", hidden=128, ffn=512, num_layers=6, num_heads=4, num_kv_heads=4, head_dim=32)
    kw = dict(context_bytes=0, ratios=(1.0,), kv_tier="host")
    budget = FIXED_BYTES + model.weight_bytes() + 512 * 2**20
    res = capacity_report(model, budget, **kw)
    off = capacity_report(model, budget, offload=offload_of("weights", EngineConfig(), model.cfg), **kw)
    assert 0 < res["l_max"] < off["l_max"] and off["offload"] == "weights" and off["kv_tier"] == "host"
    with pytest.raises(InputError, match="own store"):
        capacity_report(model, budget, offload=offload_of("weights+kv", EngineConfig(), model.cfg), **kw)


def test_plan_all_modes_with_a_block_cache_leaves_out_streamed_kv(capsys):
    assert cli_main(["plan", "--model", "dream-7b", "--budget", "24GiB", "--offload", "all",
                     "--kv-tier", "host", "--device", "cuda", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert list(rep["modes"]) == ["resident", "weights"]
    assert rep["modes"]["resident"]["l_max"] < rep["modes"]["weights"]["l_max"]
    assert all(r["kv_tier"] == "host" for r in rep["modes"].values())


def test_generate_flags_reach_the_engine(capsys):
    assert cli_main(["generate", "--device", "cpu", "--offload", "weights", "--prefetch-layers", "2",
                     "--max-new-tokens", "4", "--steps", "2", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["offload"] == "weights" and rec["memory"]["offload"] == "weights" and rec["precision"] is None
    assert cli_main(["generate", "--device", "cpu", "--prefetch-layers", "0"]) == 2
    assert "--prefetch-layers" in capsys.readouterr().err


def test_two_ranks_with_offloaded_weights_give_the_single_process_tokens(tmp_path):
    case = dict(max_new_tokens=10, steps=5)
    one = single("llada", case, 2).tokens
    outs = run(tmp_path, 2, "llada", case, 2, chunks=(2, 1, 1), opts={"offload": "weights"})
    assert all(torch.equal(o, one) for o in outs)
