"""RMSNorm's one pass in the steps (kernels.rmsnorm_kernel; models/fusion.one_pass_norms): with
fused_projections 'all' a Fast-dLLM block step's norms run the one-pass kernel where Triton runs
(here: the interpreter, elementwise_kernel 'triton'), labelled; on this CPU's default path the
norms stay PyTorch's, so the bundled models' tokens are the default's. Where the one pass runs,
its steps plan no norm scratch (fewer bytes), and the planned run agrees with its recording
(PlannedCtx checks every buffer it asks for; the sanitizer checks reads)."""

import pytest
import torch
from conftest import bundled, random_model

from mosaic import MosaicEngine, load
from mosaic.kernels import interpret

RMS = {"rms_s1", "rms_s2"}
BLOCK_KW = dict(max_new_tokens=8, steps=8, block_length=4, threshold=0.9)


def _kw(family, cache):
    return dict(BLOCK_KW, cache=cache, **({"alg": "maskgit_plus"} if family == "dream" else {}))


def _templates(engine, mode):
    """(key, template) of every recorded step of a block cache's mode (fill | block)."""
    return [(k, t) for k, t in engine.templates._templates.items()
            if any(isinstance(p, tuple) and p[:2] == ("kv", mode) for p in k)]


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
def test_fused_all_is_labelled_and_gives_the_default_tokens_on_the_cpu(name):
    family = "dream" if "dream" in name else "llada"
    every = MosaicEngine(load(bundled(name)), {"progress": False, "fused_projections": "all"})
    plain = MosaicEngine(load(bundled(name)), {"progress": False})
    assert every.model.dtype == torch.float32
    for cache, prompt in (("dual", ["57+384=", "sort 907="]), ("prefix", "sort 31415926=")):
        a, b = every.generate(prompt, **_kw(family, cache)), plain.generate(prompt, **_kw(family, cache))
        assert torch.equal(a.tokens, b.tokens), cache
        assert any("RMSNorms run in one pass" in lab for lab in a.lossy)
        assert not any("fused_projections" in lab for lab in b.lossy)


@pytest.mark.skipif(not interpret(), reason="the Triton interpreter on the CPU")
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_one_pass_block_steps_plan_no_norm_scratch(family):
    """Interpreted Triton kernels: the fused-all engine's block steps record no norm scratch (its
    fills and the default engine's block steps do), so fewer buffer bytes, run under the
    sanitizer, and give the default's tokens (fp32: the sum orders differ in the last bits only)."""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(6, 30, (7,), generator=g).tolist()
    cfg = {"progress": False, "elementwise_kernel": "triton", "sanitize": True}
    every = MosaicEngine(random_model(family), dict(cfg, fused_projections="all"))
    plain = MosaicEngine(random_model(family), cfg)
    a, b = every.generate(prompt, **_kw(family, "dual")), plain.generate(prompt, **_kw(family, "dual"))
    assert torch.equal(a.tokens, b.tokens)
    blocks = dict(_templates(every, "block"))
    assert blocks and not any(RMS & {buf.name for buf in t.buffers} for t in blocks.values())
    assert all(RMS <= {buf.name for buf in t.buffers} for _, t in _templates(every, "fill"))
    both = [(key, t) for key, t in _templates(plain, "block") if key in blocks]
    assert both
    for key, t in both:   # fewer buffer bytes; the plan's peak is elsewhere at these widths, never higher
        assert RMS <= {buf.name for buf in t.buffers}
        assert sum(b.nbytes for b in blocks[key].buffers) < sum(b.nbytes for b in t.buffers)
        assert every.templates.plan(blocks[key], key).total_bytes <= plain.templates.plan(t, key).total_bytes


@pytest.mark.skipif(not interpret(), reason="the Triton interpreter on the CPU")
def test_batch_invariant_mode_runs_every_norm_in_one_pass():
    """batch_invariant with the Triton kernels (CUDA, or here the interpreter): every norm is the
    one-pass kernel (the composed path's order, one launch), so no step plans norm scratch."""
    engine = MosaicEngine(random_model("llada"), {"progress": False, "batch_invariant": True, "sanitize": True,
                                                  "elementwise_kernel": "triton"})
    engine.generate([7, 8, 9, 10], max_new_tokens=4, steps=4)
    tpls = list(engine.templates._templates.values())
    assert tpls and not any(RMS & {buf.name for buf in t.buffers} for t in tpls)
