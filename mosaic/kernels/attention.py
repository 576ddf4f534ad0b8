"""Bidirectional (non-causal) attention into a caller-given buffer: the spec and its dispatch.

The kernel lives in attention_triton.py (FlashAttention-2 forward, Dao 2023, with optional
flash-decoding split-K and block sparsity), its PyTorch oracle in attention_ref.py, the sparse
layout format in attention_layout.py. `kernels.want_triton` picks the path.

Split-K planning (how many key splits, the workspace) is in attention_split.py.
"""

from __future__ import annotations

import torch

from . import want_triton
from .attention_layout import BlockLayout
from .attention_ref import attention_ref
from .attention_split import num_splits, split_workspace_elems, workspace_bytes  # noqa: F401


def attention_flops(nq: int, nk: int, hq: int, hd: int, density: float = 1.0) -> float:
    """Multiply-add FLOPs of one call: 2 matmuls (q k^T and p v) of 2 * nq * Nk * hd each, per
    query head, times the fraction of tiles computed. Softmax exponentials are not counted."""
    return 4.0 * nq * nk * hd * hq * density


def attention_into(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   lse: torch.Tensor | None = None, layout: BlockLayout | None = None,
                   impl: str = "auto", scale: float | None = None, key_start: int = 0,
                   workspace: torch.Tensor | None = None, splits: int | None = None,
                   tma: bool | None = None) -> None:
    """out = softmax(q k^T * scale) v, bidirectional, grouped-query; nothing allocated by the
    Triton path except a split-K workspace when none is given.

    q    [nq, Hq, hd]   bf16/fp16/fp32; last dim contiguous, any row and head strides (a view
                        `x.view(n, Hq, hd)` of a planned [n, Hq*hd] buffer works)
    k, v [Nk, Hkv, hd]  same dtype; Hq = G * Hkv, query head h reads kv head h // G
    out  [nq, Hq * hd]  (or [nq, Hq, hd]) output in q's dtype, last dim contiguous; must not
                        overlap q (in place over q gave wrong results on the H200: refused)
    lse  [Hq, nq] fp32  optional: natural-log log-sum-exp per (head, row), for merging partial
                        results over key blocks (reference.merge_partial); -inf for a row that
                        reads no key
    layout              block-sparse pattern (BlockLayout); None = dense
    impl                'auto' | 'triton' | 'torch', passed to kernels.want_triton
    scale               softmax scale, 1 / sqrt(hd) by default
    key_start           keys before it are not attended (left padding): the same as passing
                        k[key_start:], v[key_start:] (and a layout made for Nk - key_start keys)
    workspace           fp32 or uint8 tensor of >= workspace_bytes(nq, Hq, hd, Nk) bytes for the
                        split-K partials; allocated here when needed and not given
    splits              force the number of key splits (tests); default num_splits(nq, Hq, Nk)
    tma                 Triton only: K/V through TMA tensor descriptors (Hopper+); None = default

    Accumulates in fp32 (fp32 inputs use IEEE dots, so the CPU interpreter is exact to ~1e-6).
    Offsets are int64: Nk * Hkv * hd may exceed 2^31. Raises ValueError on mismatched shapes,
    dtypes, strides or layouts."""
    if key_start:
        k, v = k[key_start:], v[key_start:]
    _check(out, q, k, v, lse, layout)
    if want_triton(q.device.type, impl):
        from . import attention_triton as T
        T.attention_fwd(out, q, k, v, lse=lse, layout=layout, scale=scale, workspace=workspace,
                        splits=splits, tma=tma)
    else:
        attention_ref(out, q, k, v, lse=lse, layout=layout, scale=scale)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    ea, eb = a.element_size(), b.element_size()
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + ea * (1 + sum((s - 1) * st for s, st in zip(a.shape, a.stride())))
    b1 = b0 + eb * (1 + sum((s - 1) * st for s, st in zip(b.shape, b.stride())))
    return a.numel() > 0 and b.numel() > 0 and a0 < b1 and b0 < a1


def _check(out, q, k, v, lse, layout) -> None:
    if _overlap(out, q):
        raise ValueError("attention_into: out must not overlap q (write into a separate buffer)")
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"want q [nq, Hq, hd], k = v [Nk, Hkv, hd]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    nq, hq, hd = q.shape
    hkv = k.shape[1]
    if k.shape[2] != hd or hkv == 0 or hq % hkv:
        raise ValueError(f"q heads {hq} x {hd} do not group over k heads {hkv} x {k.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype == out.dtype):
        raise ValueError(f"dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}, out {out.dtype}")
    if tuple(out.shape) not in ((nq, hq * hd), (nq, hq, hd)):
        raise ValueError(f"out is {tuple(out.shape)}, want [{nq}, {hq * hd}] or [{nq}, {hq}, {hd}]")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (strides {t.stride()})")
    if lse is not None and (tuple(lse.shape) != (hq, nq) or lse.dtype != torch.float32
                            or (lse.numel() and lse.stride(1) != 1)):
        raise ValueError(f"lse must be fp32 [{hq}, {nq}] with contiguous rows, got {tuple(lse.shape)} {lse.dtype}")
    if layout is not None:
        layout.check(nq, k.shape[0], hq, hkv)
