"""Tensor parallelism with CUDA tensors (skipped without CUDA): two gloo ranks sharing one GPU
(NCCL refuses two ranks on one GPU) give the single-process tokens in float32 (each engine copies
its rank's slices of the bundled model; the CLI tests read them from the files)."""

import pytest
import torch
from conftest import needs_cuda

pytestmark = [pytest.mark.gpu, needs_cuda]


@pytest.mark.parametrize("family, case", [
    ("tiny-llada", dict(max_new_tokens=8, steps=8)),
    ("tiny-llada", dict(max_new_tokens=8, steps=4, block_length=4, cache="dual")),
    ("tiny-dream", dict(max_new_tokens=8, steps=8, alg="entropy")),
])
def test_two_ranks_on_one_gpu_give_the_single_process_tokens(tmp_path, family, case):
    from ranks import run, single
    one = single(family, case, 2, device="cuda").tokens.cpu()
    outs = run(tmp_path, 2, family, case, 2, device="cuda", opts={"parallel": "tensor"})
    assert all(torch.equal(o.cpu(), one) for o in outs)
