"""The device-side commit rules on CUDA (runtime/commit.py) against the published calls on the
same CUDA tensors (runtime/commit_host.py: torch.topk per row): on tie-heavy confidences every
row that is not flagged tied is committed exactly as the host commits it, settle() equals the
host everywhere; and the bfloat16 samplers' tokens on the GPU equal their per-row host loop's.
Skipped without CUDA."""

import pytest
import torch
from conftest import bundled, needs_cuda

from mosaic import MosaicEngine
from mosaic.runtime import commit as C
from mosaic.runtime import commit_host as H
from mosaic.runtime.published import topk_transfer
from mosaic.runtime.samplers import dream, fast_llada, llada

pytestmark = [pytest.mark.gpu, needs_cuda]

VALUES = torch.tensor([-float("inf"), 0.0, 0.1, 0.5, 0.8984375, 0.9, 1.0], dtype=torch.float64)


def _random(B, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    conf = VALUES[torch.randint(0, len(VALUES), (B, n), generator=g)].to(dtype)
    return conf.cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("n", [8, 32, 33, 256, 1100])   # bitonic (<= 32), warp merge, radix sorts of topk
def test_rules_equal_host_on_cuda(dtype, n):
    for seed in range(40):
        conf = _random(4, n, dtype, seed)
        k = torch.randint(0, n + 1, (4,), generator=torch.Generator().manual_seed(seed)).tolist()
        for dev, host in ((C.commit_threshold(conf, 0.9), H.select_threshold(conf, 0.9)),
                          (C.commit_factor(conf, 1.0), H.select_factor(conf, 1.0)),
                          (C.commit_counts(conf, torch.tensor(k)), topk_transfer(conf, k)),
                          (C.commit_llada2(conf, torch.tensor(k), 0.95), H.select_llada2(conf, k, 0.95)),
                          (C.commit_top_threshold(conf, torch.tensor(k), 0.9), H.select_top_threshold(conf, k, 0.9))):
            untied = ~dev.tied
            assert torch.equal(dev.mask[untied], host[untied])
            assert torch.equal(dev.settle(), host)


def _host_loop_tokens(monkeypatch, engine, prompts, **kw):
    """The run's tokens when every commit is the published call on every row (the host loop)."""
    def host_apply(x, x0, c, after=None):
        B = c.mask.shape[0]
        exact = c.exact(list(range(B)))
        x.copy_(torch.where(exact, x0, x))
        return after().long().tolist() if after is not None else []
    with monkeypatch.context() as m:
        for mod in (fast_llada, llada, dream):
            m.setattr(mod, "apply", host_apply)
        return engine.generate(prompts, **kw).tokens


@pytest.mark.parametrize("opts", [dict(), dict(cache="dual", threshold=0.9), dict(factor=1.0)])
def test_bfloat16_llada_tokens_equal_the_host_loop(monkeypatch, opts):
    e = MosaicEngine(bundled("tiny-llada"), {"progress": False, "dtype": "bfloat16", "device": "cuda"})
    prompts = ["123+456=", "8+8=", "sort 907=", "57+384="]
    kw = dict(max_new_tokens=16, steps=16, block_length=4, **opts)
    assert torch.equal(e.generate(prompts, **kw).tokens, _host_loop_tokens(monkeypatch, e, prompts, **kw))
