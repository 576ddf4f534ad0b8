"""The one place that picks kernels: which attention kernel runs where."""

import torch

from mosaic import kernels
from mosaic.kernels import reference as R


def test_cudnn_attention_is_never_chosen_off_the_gpu_or_when_told_not_to():
    devices = ("cpu", "meta") + (() if torch.cuda.is_available() else ("cuda",))  # without CUDA: never
    for dev in devices:
        for setting in ("sdpa", "cudnn"):
            assert not kernels.prefer_cudnn_attention(torch.device(dev), torch.bfloat16, 128, 4096, setting)
    if torch.cuda.is_available():  # on a GPU only when asked for
        assert not kernels.prefer_cudnn_attention(torch.device("cuda"), torch.bfloat16, 128, 4096, "sdpa")


def test_attention_without_cudnn_is_the_reference_on_the_cpu():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 4, 8, generator=g), torch.randn(7, 2, 8, generator=g), torch.randn(7, 2, 8, generator=g)
    out = torch.empty(5, 32)
    R.attention(out, q, k, v, cudnn=False)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # grouped-query heads expanded
    w = torch.softmax(torch.einsum("qhd,khd->hqk", q, kk) / 8**0.5, dim=-1)
    assert torch.allclose(out, torch.einsum("hqk,khd->qhd", w, vv).reshape(5, 32), atol=1e-5)
