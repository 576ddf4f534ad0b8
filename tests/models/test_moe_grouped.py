"""The MoE blocks (models/moe_grouped.py) over each experts kernel: the grouped GEMM gives the
per-expert loop's bits and tokens (CPU float32, tiny random LLaDA-MoE and LLaDA2 with their
routing variants), the Triton kernel (interpreter) its tokens, and a whole step -- LLaDA2's block
step with its reducer included -- reads nothing back to the host (it runs on meta tensors)."""

import dataclasses

import pytest
import torch
from conftest import TINY, random_model

from mosaic import MosaicEngine, kernels
from mosaic.config import GenerationConfig
from mosaic.graph.ctx import EagerCtx
from mosaic.memory.kv_store import KVStore, StoreLayout
from mosaic.models import allocate
from mosaic.models.block_cache import BlockCacheStep, block_program, block_step
from mosaic.models.layers import step_program
from mosaic.models.step import make_step
from mosaic.runtime.samplers.block_diffusion import BlockReducer

# LLaDA2's routing variants: group-limited sigmoid + bias + normalised + shared experts (the
# published mini), one group, softmax scores without normalisation, no shared experts
VARIANTS = {
    "llada_moe": [{}],
    "llada2": [{}, {"num_groups": 1, "topk_groups": 1}, {"route_score": "softmax", "route_norm": False},
               {"shared_ffn": 0, "route_scale": 1.0}],
}
CASES = [(f, v) for f, vs in VARIANTS.items() for v in vs]


def _logits(model, kernel, ids):
    step = make_step(model.cfg, ids, None, dtype=model.dtype)
    return step_program(EagerCtx(model.device, model.dtype, moe_kernel=kernel), model, step)


IDS = [f"{f}-{i}" for f, vs in VARIANTS.items() for i in range(len(vs))]


@pytest.mark.parametrize("family, change", CASES, ids=IDS)
def test_grouped_forward_is_the_loops_bit_for_bit(family, change):
    model = random_model(family, seed=3, **change)
    ids = torch.randint(0, model.cfg.vocab - 3, (2, 13), generator=torch.Generator().manual_seed(1))
    loop = _logits(model, "loop", ids)
    assert torch.equal(_logits(model, "grouped", ids), loop)


def _generate(model, kernel, prompts, family):
    engine = MosaicEngine(model, {"progress": False, "moe_kernel": kernel})
    opts = dict(max_new_tokens=8, block_length=4, steps=4 if family == "llada2" else 8)
    if family == "llada2":
        opts["threshold"] = 0.5
    return engine.generate(prompts, **opts).tokens


@pytest.mark.parametrize("family, change", [*CASES[:2], pytest.param(*CASES[2], marks=pytest.mark.slow)],
                         ids=["llada_moe", "llada2", "llada2-1group"])
def test_tokens_equal_the_loops(family, change):
    model = random_model(family, seed=5, **change)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3]]
    ref = _generate(model, "loop", prompts, family)
    assert torch.equal(_generate(model, "grouped", prompts, family), ref)


@pytest.mark.parametrize("family", [pytest.param("llada_moe", marks=pytest.mark.slow), "llada2"])
def test_triton_kernel_gives_the_loops_tokens(family):
    """Its own summation order (labelled lossy); float32 on these models: the same tokens."""
    pytest.importorskip("triton")
    if not kernels.interpret():
        pytest.skip("CPU tensors run the Triton kernel under TRITON_INTERPRET=1 (tests/gpu: on CUDA)")
    model = random_model(family, seed=5)
    prompts = [[3, 1, 4, 1, 5, 9, 2]]
    runs = {k: MosaicEngine(model, {"progress": False, "moe_kernel": k}).generate(
        prompts, max_new_tokens=4, block_length=4, steps=4) for k in ("loop", "triton")}
    assert torch.equal(runs["triton"].tokens, runs["loop"].tokens)
    assert any("moe_kernel=triton" in label for label in runs["triton"].lossy)
    assert not any("moe_kernel" in label for label in runs["loop"].lossy)


def _meta_model(family):
    cfg = dataclasses.replace(TINY[family], ffn=16)     # bf16 rows of whole 16 bytes (grouped_mm)
    return allocate(cfg, "meta", torch.bfloat16, name="meta")[0]


@pytest.mark.parametrize("family", ["llada_moe", "llada2"])
def test_forward_reads_nothing_on_the_host(family):
    """Meta tensors have no data: any .item(), .tolist(), bincount, nonzero or boolean index
    raises. The whole forward runs with the grouped kernel; with the loop it cannot (the
    detector fails where it should)."""
    model = _meta_model(family)
    ids = torch.zeros(2, 12, dtype=torch.long, device="meta")
    assert _logits(model, "grouped", ids).shape == (24, model.cfg.vocab)
    with pytest.raises((NotImplementedError, RuntimeError)):
        _logits(model, "loop", ids)


def test_llada2_block_step_reads_nothing_on_the_host():
    """The step a captured LLaDA2 block step replays: a padded batch of two, the block and the
    block finished before it, the store, block-causal attention and the reducer."""
    model = _meta_model("llada2")
    cfg, dev, bf = model.cfg, torch.device("meta"), torch.bfloat16
    B, W, block = 2, 16, 4
    layout = StoreLayout.of(cfg, B, W, 2)
    store = KVStore(layout, dev, bf)
    spec = BlockCacheStep(4, 12, block, W, store, layout.device_bytes)
    rows = torch.zeros(6, dtype=torch.long, device=dev)
    step = block_step(torch.zeros(B, W, dtype=torch.long, device=dev), (0, 4), spec, rows=rows,
                      reducer=BlockReducer(GenerationConfig(max_new_tokens=8), None))
    store.begin("block", 4, W)
    out = block_program(EagerCtx(dev, bf, moe_kernel="grouped"), model, step)
    assert out["x0"].shape == out["conf"].shape == (6,)
