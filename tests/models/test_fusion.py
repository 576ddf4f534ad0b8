"""Fused projections (models/fusion.py): the fused matrices replace the separate ones (the parts
are views, weight bytes unchanged), the engine fuses gate|up by default and its tokens equal the
unfused engine's for every family, plain and block-cache steps; layers moved off the device drop
their fused matrices and get them back."""

import pytest
import torch
from conftest import random_model

from mosaic import MosaicEngine
from mosaic.models.fusion import fuse_layer


def _inside(part: torch.Tensor, whole: torch.Tensor) -> bool:
    a, n = whole.data_ptr(), whole.numel() * whole.element_size()
    return a <= part.data_ptr() and part.data_ptr() + part.numel() * part.element_size() <= a + n


@pytest.mark.parametrize("family", ["llada", "dream", "illada", "llada_moe", "llada2"])
def test_fused_matrices_replace_the_parts(family):
    model = random_model(family)
    before = model.weight_bytes()
    want = [{k: t.clone() for k, t in lw.items()} for lw in model.layers]
    model.fuse_projections(("qkv", "gate_up"))
    assert model.weight_bytes() == before and model.layer_bytes() == [sum(
        t.numel() * t.element_size() for t in lw.values()) for lw in want]
    for lw, fw, ref in zip(model.layers, model.fused, want):
        assert all(torch.equal(lw[k], ref[k]) for k in ref)        # same values, now views
        assert _inside(lw["q"], fw["qkv"]) and _inside(lw["v"], fw["qkv"])
        if "gate" in ref:
            assert _inside(lw["up"], fw["gate_up"]) and lw["up"].is_contiguous()
        else:
            assert "gate_up" not in fw                              # MoE layers: experts, not fused
    again = [dict(f) for f in model.fused]
    model.fuse_projections(("qkv", "gate_up"))                     # idempotent: nothing copied again
    assert all(f[k] is again[i][k] for i, f in enumerate(model.fused) for k in f)


def test_adjacent_parts_are_not_copied():
    whole = torch.randn(12, 4)
    lw = {"q": whole[:4], "k": whole[4:8], "v": whole[8:]}
    fused = fuse_layer(lw, ("qkv",))
    assert fused["qkv"].data_ptr() == whole.data_ptr() and torch.equal(fused["qkv"], whole)


def test_fp8_layers_are_not_fused():
    lw = {"gate": torch.zeros(4, 2), "up": torch.zeros(4, 2), "gate_scale": torch.ones(4)}
    assert fuse_layer(lw, ("gate_up",)) == {}


def test_moving_layers_drops_and_restores_the_fused_matrices():
    model = random_model("llada")
    model.fuse_projections(("gate_up",))
    layers = [{k: t.clone() for k, t in lw.items()} for lw in model.layers]
    model.set_packed_layers(layers, [torch.empty(0) for _ in layers])   # offloaded: no fused matrices
    assert model.fused is None
    model.set_packed_layers([{k: t.clone() for k, t in lw.items()} for lw in layers], None)
    assert model.fused is not None and _inside(model.layers[0]["gate"], model.fused[0]["gate_up"])


@pytest.mark.parametrize("family", ["llada", "dream", "illada", "llada2"])
def test_fused_engine_tokens_equal_unfused(family):
    """Default engine (gate|up fused in block steps) against fused_projections='off': plain steps
    (not fused) and, for LLaDA and Dream, the block caches (one chunk: the block-step path with
    per-step RoPE tables and the residual added in the FFN's norm)."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(6, 30, (n,), generator=g).tolist() for n in (5, 9)]    # iLLaDA's mask id is 5
    fused_model, plain_model = random_model(family), random_model(family)
    fused = MosaicEngine(fused_model, {"progress": False})
    plain = MosaicEngine(plain_model, {"progress": False, "fused_projections": "off"})
    assert fused_model.fused is not None and plain_model.fused is None
    runs = [dict(max_new_tokens=8, steps=8)]
    if family == "llada2":
        runs = [dict(max_new_tokens=8, steps=4, block_length=4)]
    elif family in ("llada", "dream"):
        runs += [dict(max_new_tokens=8, steps=8, block_length=4, cache=c, threshold=0.9,
                      **({"alg": "maskgit_plus"} if family == "dream" else {})) for c in ("dual", "prefix")]
    for kw in runs:
        for p in (prompts, prompts[0]):
            assert torch.equal(fused.generate(p, **kw).tokens, plain.generate(p, **kw).tokens), kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family, cache", [("llada", "dual"), ("llada", "prefix"), ("dream", "dual"),
                                           ("llada_moe", "dual"), ("illada", "prefix")])
def test_block_path_equals_per_chunk_path(family, cache, dtype, monkeypatch):
    """The one-chunk block step's path (models/kv_cache._block_attention: RoPE tables per step,
    one norm, q and k in one rope call, the residual added in the FFN's norm) gives the per-chunk
    path's tokens, alone and in a batch (_batched_attention with the tables)."""
    from mosaic.models import kv_cache
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(6, 30, (n,), generator=g).tolist() for n in (6, 10)]   # iLLaDA's mask id is 5
    kw = dict(max_new_tokens=8, steps=8, block_length=4, cache=cache, threshold=0.9)
    if family == "dream":
        kw["alg"] = "maskgit_plus"
    got = {}
    for path in (False, True):
        monkeypatch.setattr(kv_cache, "BLOCK_PATH", path)
        e = MosaicEngine(random_model(family, dtype=dtype), {"progress": False})
        got[path] = [e.generate(p, **kw).tokens for p in (prompts, prompts[1])]
    assert all(torch.equal(a, b) for a, b in zip(got[False], got[True]))


@pytest.mark.parametrize("family", ["llada", "dream", "illada"])
def test_fused_qkv_is_labelled_and_gives_the_tokens_on_the_cpu(family):
    """fused_projections='all' (q|k|v as one GEMM in block steps, one kernel for the rotations and
    the store writes): labelled; on this CPU the wider product rounds as the three (MKL), so the
    tokens are the unfused engine's."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(6, 30, (n,), generator=g).tolist() for n in (5, 9)]
    kw = dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.9,
              **({"alg": "maskgit_plus"} if family == "dream" else {}))
    every = MosaicEngine(random_model(family), {"progress": False, "fused_projections": "all"})
    plain = MosaicEngine(random_model(family), {"progress": False, "fused_projections": "off"})
    for p in (prompts[1], prompts):
        a, b = every.generate(p, **kw), plain.generate(p, **kw)
        assert torch.equal(a.tokens, b.tokens)
        assert any("fused_projections=all" in lab for lab in a.lossy)
        assert not any("fused_projections" in lab for lab in b.lossy)
