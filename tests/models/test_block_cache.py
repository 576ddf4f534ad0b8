"""LLaDA2's batched block step (models/block_cache.py): a batch's (sequence, block) attention
entries, the batch's tokens equal to the per-block path's and to each prompt alone (CPU float32),
with the loop and with the gather kernel (device tensors only: what a captured step replays), and
the batched step reads nothing back to the host (meta tensors)."""

import dataclasses

import pytest
import torch
from conftest import TINY, random_model

from mosaic import MosaicEngine
from mosaic.config import GenerationConfig
from mosaic.graph.ctx import EagerCtx
from mosaic.memory.kv_store import KVStore, StoreLayout
from mosaic.models import allocate
from mosaic.models.block_cache import BlockCacheStep, block_index, block_program, block_step
from mosaic.runtime.samplers.block_diffusion import BlockReducer


def test_entries_are_block_causal_per_sequence():
    spec = BlockCacheStep(a=4, hi=12, block=4, length=16)
    idx = block_index(spec, (0, 8), "cpu", "loop")
    e = idx.entries
    assert e.q_count == (4, 4, 4, 4) and e.q_first == (0, 4, 8, 12)
    # sequence 0 (no padding): blocks [4, 8) and [8, 12) see keys [0, 8) and [0, 12) of row 0;
    # sequence 1 (padding 8): its first block lies in the padding (no keys), its second sees [8, 12)
    assert e.k_first == (0, 0, 24, 24) and e.k_count == (8, 12, 0, 4)
    assert idx.write_rows.tolist() == [*range(4, 12), *range(20, 28)]


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [3, 5], [8, 9, 7, 9, 3, 2]]
OPTS = dict(max_new_tokens=10, block_length=4, steps=3, threshold=0.6)


def _tokens(model, prompts, **cfg):
    out = MosaicEngine(model, {"progress": False, **cfg}).generate(prompts, **OPTS)
    return out.tokens, out


@pytest.mark.parametrize("varlen", ["loop", "gather"])
def test_batched_block_steps_give_each_prompts_tokens_alone(varlen, monkeypatch):
    monkeypatch.setenv("MOSAIC_VARLEN", varlen)
    model = random_model("llada2", seed=2)
    batch, out = _tokens(model, PROMPTS)
    for b, p in enumerate(PROMPTS):
        alone, _ = _tokens(model, [p])
        assert batch[b].tolist() == alone[0].tolist(), (b, varlen)
    assert any(varlen in label for label in out.lossy) == (varlen != "loop")


def test_batched_and_per_block_attention_agree():
    model = random_model("llada2", seed=2)
    batched, _ = _tokens(model, PROMPTS)
    per_block, _ = _tokens(model, PROMPTS, chunks=(2, 1, 1))     # chunked attention: the per-block path
    assert torch.equal(batched, per_block)


@pytest.mark.parametrize("kernel", ["gather", "flash"])
def test_batched_block_step_reads_nothing_on_the_host(kernel):
    cfg = dataclasses.replace(TINY["llada2"], ffn=16)            # bf16 rows of whole 16 bytes
    dev, bf = torch.device("meta"), torch.bfloat16
    model = allocate(cfg, "meta", bf, name="meta")[0]
    B, W, block = 2, 16, 4
    layout = StoreLayout.of(cfg, B, W, 2)
    store = KVStore(layout, dev, bf)
    spec = BlockCacheStep(4, 12, block, W, store, layout.device_bytes)
    step = block_step(torch.zeros(B, W, dtype=torch.long, device=dev), (0, 4), spec, kernel,
                      rows=torch.zeros(6, dtype=torch.long, device=dev),
                      reducer=BlockReducer(GenerationConfig(max_new_tokens=8), None))
    assert step.cache.index is not None
    store.begin("block", 4, W)
    out = block_program(EagerCtx(dev, bf, moe_kernel="grouped"), model, step)
    assert out["x0"].shape == (6,)
