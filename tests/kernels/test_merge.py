"""The fused merge of partial attention (Triton; the interpreter on a CPU) against the PyTorch
merge, and merged key blocks against attention over all keys."""

import pytest
import torch

from mosaic.kernels import reference as R
from mosaic.kernels.merge import merge_partial

DEV = "cuda" if torch.cuda.is_available() else "cpu"   # the interpreter on a CPU (conftest)


@pytest.mark.parametrize("hq, hkv, nq, hd", [(4, 4, 37, 16), (6, 2, 20, 24), (2, 1, 1, 8)])
def test_triton_merge_matches_the_torch_merge(hq, hkv, nq, hd):
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(hq + nq)
    q = torch.randn(nq, hq, hd, generator=g).to(DEV)
    k, v = (torch.randn(50, hkv, hd, generator=g).to(DEV) for _ in range(2))
    acc, lse = R.attention_partial(q, k[:20], v[:20])
    o, l_ = R.attention_partial(q, k[20:], v[20:], native=True)   # the kernel's own strided output
    a1, l1 = acc.clone(), lse.clone()
    merge_partial(a1, l1, o, l_, impl="torch")
    a2, l2 = acc.clone(), lse.clone()
    merge_partial(a2, l2, o, l_, impl="triton")
    torch.testing.assert_close(a2, a1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(l2, l1, rtol=1e-6, atol=1e-6)
    want = torch.empty(nq, hq * hd, device=DEV)
    R.attention(want, q, k, v)
    torch.testing.assert_close(a2.reshape(nq, -1), want, rtol=1e-5, atol=1e-5)
