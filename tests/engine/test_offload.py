"""Offload in the engine: tokens identical to the resident path, the staging slots planned and
charged, admission choosing the least streaming that fits, L_max per mode."""

import pytest
import torch
from conftest import bundled, random_model

from mosaic import MemoryBudgetError, MosaicEngine
from mosaic.config import EngineConfig
from mosaic.memory.accounting import FIXED_BYTES, input_bytes
from mosaic.policy.capacity_modes import capacity_modes
from mosaic.policy.offload import kv_min_rows, offload_of, transfer_report
from mosaic.policy.probe import probe_step

PROMPTS = ["sort 31415926=", "57+384="]


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
@pytest.mark.parametrize("offload", ["weights", "weights+kv"])
def test_offloaded_tokens_equal_the_resident_path(name, offload):
    bundled(name)
    opts = {"device": "cpu", "progress": False}
    ref = MosaicEngine(name, opts).generate(PROMPTS, max_new_tokens=8, steps=4)
    eng = MosaicEngine(name, {**opts, "offload": offload, "prefetch_layers": 2, "kv_block_rows": 5,
                              "chunks": (2, 2, 1)})
    out = eng.generate(PROMPTS, max_new_tokens=8, steps=4)
    assert torch.equal(out.tokens, ref.tokens) and out.offload == offload
    assert bool(out.lossy) == (offload == "weights+kv")        # only the K/V merge changes rounding


def test_offloaded_moe_and_padding_match_under_the_sanitizer(family):
    model = random_model(family, num_layers=3)
    opts = {"device": "cpu", "progress": False, "sanitize": True}
    ids = [[3, 4, 5, 6, 7, 8], [9, 10, 11]]                           # left padding in the batch
    ref = MosaicEngine(model, opts).generate(ids, max_new_tokens=6, steps=3)
    for off in ("weights", "weights+kv"):
        out = MosaicEngine(model, {**opts, "offload": off, "kv_block_rows": 3}).generate(ids, max_new_tokens=6, steps=3)
        assert torch.equal(out.tokens, ref.tokens), off


def big_layers():
    # layers hold most of the weights: 6 x ~1 MiB, the rest ~30 KiB
    return random_model("llada", hidden=128, ffn=512, num_layers=6, num_heads=4, num_kv_heads=4, head_dim=32)


def need(engine, mode, n=40, masked=8):
    step = probe_step(engine.model, n, masked).with_(offload=offload_of(mode, engine.config, engine.model.cfg))
    return engine.preparer.prepare(step, remember=False)


def test_staging_slots_are_planned_and_charged():
    model = big_layers()
    eng = MosaicEngine(model, {"device": "cpu", "progress": False, "offload": "weights", "prefetch_layers": 2})
    prep = need(eng, "weights")
    stage = [b for b in prep.template.buffers if b.name == "w_stage"]
    assert len(stage) == 3 and all(b.nbytes >= max(model.layer_bytes()) for b in stage)
    assert prep.plan_bytes - need(eng, "resident").plan_bytes >= 3 * max(model.layer_bytes())
    assert eng.offload_budget.weights_bytes == model.weight_bytes(layers=False) < model.weight_bytes() / 10


def test_auto_runs_offloaded_when_resident_does_not_fit():
    model = big_layers()
    probe = MosaicEngine(model, {"device": "cpu", "progress": False})
    w = need(probe, "weights").need_bytes
    budget = FIXED_BYTES + model.weight_bytes(layers=False) + w + input_bytes(1, 40) + 4096
    assert budget < FIXED_BYTES + model.weight_bytes() + need(probe, "resident").need_bytes   # resident cannot
    opts = {"device": "cpu", "progress": False, "memory_budget": budget}
    with pytest.raises(MemoryBudgetError):
        MosaicEngine(model, opts).generate([list(range(3, 35))], max_new_tokens=8, steps=2)
    eng = MosaicEngine(model, {**opts, "offload": "auto"})
    out = eng.generate([list(range(3, 35))], max_new_tokens=8, steps=2)
    assert out.offload == "weights"
    ref = MosaicEngine(model, {"device": "cpu", "progress": False}).generate([list(range(3, 35))], max_new_tokens=8,
                                                                              steps=2)
    assert torch.equal(out.tokens, ref.tokens)
    # without a budget everything fits resident: auto takes the least streaming
    free = MosaicEngine(model, {"device": "cpu", "progress": False, "offload": "auto"})
    assert free.generate([[3, 4]], max_new_tokens=2, steps=1).offload == "resident"


def test_nothing_fits_is_refused_with_the_longest_for_the_last_mode():
    model = big_layers()
    # above what even the most streamed mode holds before any token: built, then refused per request
    budget = FIXED_BYTES + model.weight_bytes(layers=False) + 1024
    opts = {"device": "cpu", "progress": False, "memory_budget": budget, "offload": "auto"}
    with pytest.raises(MemoryBudgetError, match="longest that fits: 0 tokens"):
        MosaicEngine(model, opts).generate([[3, 4, 5]], max_new_tokens=4, steps=1)
    # below it: refused when the engine is built, naming the offloaded mode's fixed bytes
    with pytest.raises(MemoryBudgetError, match="below what .* holds before any token"):
        MosaicEngine(model, {**opts, "memory_budget": FIXED_BYTES + 1024})
    # a budget that only the offloaded modes fit builds with offload, not without it
    with pytest.raises(MemoryBudgetError, match="below what"):
        MosaicEngine(model, {**opts, "offload": "off", "memory_budget": FIXED_BYTES + model.weight_bytes() - 1})
    MosaicEngine(model, {**opts, "offload": "weights", "memory_budget": FIXED_BYTES + model.weight_bytes() - 1})


def test_lmax_grows_with_each_mode_and_the_ratio_is_reported():
    model = big_layers()
    rep = capacity_modes(model, FIXED_BYTES + 512 * 2**20, context_bytes=0, ratios=(1.0,))
    lm = {m: r["l_max"] for m, r in rep["modes"].items()}
    assert 0 < lm["resident"] < lm["weights"] < lm["weights+kv"]
    kv = rep["modes"]["weights+kv"]
    assert kv["floor_bytes_per_token"] == model.cfg.hidden * 4 and kv["steps"][0]["host_bytes"] > 0
    for r in rep["modes"].values():
        assert r["transfer"]["transfer_to_compute"] >= 0


def test_transfer_ratio_and_kv_row_floor():
    from mosaic import load
    m = load("llada-8b", device="meta")
    assert kv_min_rows(m.cfg) == 11264
    t = transfer_report(m, 65536, "weights")
    assert t["transfer_bytes_per_layer"] == max(m.layer_bytes()) and t["transfer_to_compute"] < 0.05
    kv = transfer_report(m, 262144, "weights+kv", attn_chunks=4)
    assert kv["transfer_bytes_per_layer"] > 5 * 2 * 262144 * 4096 * 2 - 1


def test_config_checks():
    with pytest.raises(Exception, match="offload"):
        EngineConfig(offload="disk")
    with pytest.raises(Exception, match="prefetch_layers"):
        EngineConfig(prefetch_layers=0)
