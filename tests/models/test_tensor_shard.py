"""Tensor parallelism's weight side without processes: which slice each rank holds, read from a
checkpoint (only that slice) or cut from a model in memory, and the errors for what cannot split."""

import dataclasses

import pytest
import torch
from conftest import TINY, random_model

from mosaic.config import EngineConfig
from mosaic.errors import InputError
from mosaic.graph.tensor import TensorShard
from mosaic.loader import load
from mosaic.models.tensor_shard import check_divides, cut, full_tensors, shard_model


@pytest.mark.parametrize("family", ["llada", "dream", "llada_moe"])
def test_shards_read_from_the_files_are_the_slices_and_cover_the_model(saved, family):
    folder, full = saved(family)
    parts = [load(folder, "cpu", "float32", tensor=TensorShard(r, 2)) for r in range(2)]
    whole, cfg = full_tensors(full), full.cfg
    for r, part in enumerate(parts):
        assert part.tensor == TensorShard(r, 2)
        assert part.cfg.num_kv_heads == cfg.num_kv_heads // 2
        assert part.cfg.ffn == (cfg.ffn if cfg.num_experts else cfg.ffn // 2)   # MoE: whole experts
        mem = shard_model(full, TensorShard(r, 2))
        for canon, t in full_tensors(part).items():     # the file's slice == the in-memory cut
            assert torch.equal(t, full_tensors(mem)[canon]), canon
    for canon, t in whole.items():    # the two ranks' slices put back together give the full tensor
        where = cut(canon, cfg, TensorShard(0, 2))
        got = [full_tensors(p).get(canon) for p in parts]
        if ".experts_" in canon:      # a routed expert lives whole on exactly one rank
            held = [g for g in got if g is not None]
            assert len(held) == 1 and torch.equal(held[0], t), canon
            continue
        assert torch.equal(t, got[0] if where is None else torch.cat(got, dim=where[0])), canon
        if where is None:
            assert torch.equal(got[0], got[1])
    if cfg.num_experts:    # experts split whole: rank 1 holds experts 4-7 of 8, at full width
        assert parts[1].layers[0]["experts_gate"].shape == (cfg.num_experts // 2, cfg.ffn, cfg.hidden)


def test_grouped_heads_stay_with_their_kv_head():
    cfg = TINY["dream"]     # 4 q heads reading 2 K/V heads: rank 1 holds q heads 2, 3 and K/V head 1
    hd = cfg.head_dim
    assert cut("layers.0.k", cfg, TensorShard(1, 2)) == (0, hd, 2 * hd)
    assert cut("layers.0.q", cfg, TensorShard(1, 2)) == (0, 2 * hd, 4 * hd)
    assert cut("layers.0.o", cfg, TensorShard(1, 2)) == (1, 2 * hd, 4 * hd)
    assert cut("layers.1.down", cfg, TensorShard(1, 2)) == (1, cfg.ffn // 2, cfg.ffn)
    assert cut("layers.1.ffn_norm", cfg, TensorShard(1, 2)) is None and cut("embed", cfg, TensorShard(1, 2)) is None


def test_the_o_bias_is_added_by_rank_0_only():
    full = random_model("illada", o_bias=True)
    r0, r1 = (shard_model(full, TensorShard(r, 2)) for r in range(2))
    assert torch.equal(r0.layers[0]["o_bias"], full.layers[0]["o_bias"])
    assert not r1.layers[0]["o_bias"].any()


def test_what_cannot_split_is_one_clear_error():
    with pytest.raises(InputError, match=r"2 K/V heads and 4 attention heads \(not divisible by 3\); "
                       r"use 1 or 2 processes"):
        check_divides(TINY["dream"], 3)
    with pytest.raises(InputError, match=r"heads and experts evenly, but the model has 4 K/V heads and 4 attention "
                       r"heads and 8 experts \(not divisible by 3\); use 1 or 2 or 4 processes"):
        check_divides(TINY["llada_moe"], 3)
    with pytest.raises(InputError, match="tensor parallelism supports dream, illada, llada, llada_moe"):
        check_divides(TINY["llada2"], 2)
    with pytest.raises(InputError, match="parallel='pipeline'"):
        EngineConfig(parallel="pipeline")
    with pytest.raises(InputError, match="load it again"):
        shard_model(shard_model(random_model("llada"), TensorShard(0, 2)), TensorShard(0, 2))


def test_each_rank_plans_a_smaller_step():
    """The recorded step of a rank's share (meta tensors, no processes): the FFN phase's buffers
    shrink by about K (plus the [K, n, d] gather of the partial sums), attention's K/V and q too."""
    from mosaic.graph.record import record
    from mosaic.models import allocate
    from mosaic.models.layers import step_program
    from mosaic.models.tensor_shard import shard_config
    from mosaic.policy.probe import probe_step

    cfg = dataclasses.replace(TINY["llada"], ffn=512, num_heads=8, num_kv_heads=8)
    full = allocate(cfg, "meta", torch.float32)[0]
    part = allocate(shard_config(cfg, 2), "meta", torch.float32)[0]
    part.set_tensor(TensorShard(0, 2))
    peaks = [record(step_program, m, probe_step(m, 256, 128), device="meta", dtype=torch.float32).phase_peaks()
             for m in (full, part)]
    assert peaks[1]["ffn"] < 0.55 * peaks[0]["ffn"]       # measured 0.53
    assert peaks[1]["attn"] < 0.6 * peaks[0]["attn"]      # 0.54: the residual x stays whole
    assert peaks[1]["logits"] == peaks[0]["logits"]       # the LM head is replicated


def test_a_share_outside_its_process_group_is_refused():
    from mosaic import MosaicEngine
    with pytest.raises(InputError, match="holds rank 1's share of 2"):
        MosaicEngine(shard_model(random_model("llada"), TensorShard(1, 2)), {"progress": False})
