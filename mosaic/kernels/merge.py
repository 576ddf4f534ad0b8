"""Merging partial attention results (sequence parallelism): the dispatch between the fused
Triton merge (merge_triton.py, on CUDA) and the PyTorch one (reference.merge_partial, the CPU
path and the oracle)."""

from __future__ import annotations

import torch

from . import reference as R
from . import want_triton


def merge_partial(acc: torch.Tensor, acc_lse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                  impl: str = "auto") -> None:
    """Fold one key block's (o [nq, H, hd], lse fp32 [H, nq]) into the running (acc fp32
    [nq, H, hd], acc_lse fp32 [H, nq]) in place (log-sum-exp form, FlashAttention's online
    softmax across blocks). impl: 'auto' | 'triton' | 'torch' (kernels.want_triton). Allocates
    nothing on the Triton path; the PyTorch path allocates a few [H, nq] fp32 vectors."""
    if want_triton(acc.device.type, impl) and acc.is_contiguous() and acc_lse.is_contiguous():
        from . import merge_triton as T
        T.merge(acc, acc_lse, o, lse)
    else:
        R.merge_partial(acc, acc_lse, o, lse)
