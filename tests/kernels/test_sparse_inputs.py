"""No block-selection op modifies its inputs: the model's queries and keys are read, never
written (a float32 q's .float() is q itself, so taking its positive part in place once clamped
the model's queries and made keep 1.0 differ from dense attention)."""

import pytest
import torch
from conftest import random_model

from mosaic import MosaicEngine
from mosaic.kernels.sparse_select import block_means_into, block_minmax_into, row_bound_scores_into


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selection_ops_leave_q_and_k_unchanged(dtype):
    g = torch.Generator().manual_seed(0)
    nq, hkv, grp, hd, block = 40, 2, 2, 8, 16
    q = torch.randn(nq, hkv * grp, hd, generator=g).to(dtype)
    k = torch.randn(nq, hkv, hd, generator=g).to(dtype)
    q0, k0 = q.clone(), k.clone()
    nb = -(-nq // block)
    bounds = torch.empty(2, hkv, nb, hd)
    block_minmax_into(bounds, k, block)
    block_means_into(torch.empty(hkv, nb, hd), q, block, grp)
    row_bound_scores_into(torch.empty(hkv, nb, nb), q, bounds, block)
    assert torch.equal(q, q0) and torch.equal(k, k0)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_rows_estimate_keeping_every_block_equals_dense_logits(family):
    """Step by step, not only the final tokens: every step's prediction equals dense attention's."""
    model = random_model(family)
    cfg = {"block": 16, "dense_steps": 0, "estimate": "rows",
           "ranges": [{"layers": [0, model.cfg.num_layers - 1], "pattern": "topk", "keep": 1.0}]}
    kw = dict(max_new_tokens=12, steps=6, seed=0)
    prompt = list(range(1, 20))
    dense, sparse = [], []
    MosaicEngine(model, {"progress": False, "attention": "triton"}).generate(
        prompt, on_step=lambda i, x: dense.append(x.clone()), **kw)
    MosaicEngine(model, {"progress": False, "sparse": cfg}).generate(
        prompt, on_step=lambda i, x: sparse.append(x.clone()), **kw)
    assert all(torch.equal(a, b) for a, b in zip(dense, sparse)) and len(dense) == len(sparse)
