"""Fused projection weights: q|k|v as one [q_dim + 2 kv_dim, d] matrix and gate|up as one
[2F, d] matrix per layer, so a step runs one GEMM where it ran three or two (fewer launches and
no split-K of a 32-row block step's narrow GEMMs: docs/FAST_DECODING.md).

Weight memory does not double: the fused matrix replaces the separate ones, and the layer dict's
q, k, v (gate, up) become row-slice views of it. A row slice of a contiguous [out, in] matrix is
itself contiguous with the same strides, so every op that reads the parts (the native forward,
the unfused program, the byte counts) sees the same tensors it saw before; weight_bytes counts
the parts, which sum to the fused matrix. Where the parts already are adjacent slices of one
tensor (LLaDA2's query_key_value) that tensor is used, nothing is copied.

Not fused: FP8 layers (their scales are per part), MoE experts (models/moe_grouped.py), a tensor-
parallel share (its row-parallel sums), layers streamed from host memory (placement drops the
fused matrices when it moves the layers and fuses again when they come back)."""

from __future__ import annotations

import torch

FUSIONS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def fuse_layer(lw: dict[str, torch.Tensor], parts: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The fused matrices of one layer ({"qkv", "qkv_bias", "gate_up"} where its parts exist);
    lw's parts become views of them (in place)."""
    out = {}
    for name in parts:
        keys = FUSIONS[name]
        if not all(k in lw and lw[k].dim() == 2 for k in keys) or any(k + "_scale" in lw for k in keys):
            continue
        out[name] = _fuse(lw, keys)
        if all(k + "_bias" in lw for k in keys):
            out[name + "_bias"] = _fuse(lw, tuple(k + "_bias" for k in keys))
    return out


def _fuse(lw: dict[str, torch.Tensor], keys: tuple[str, ...]) -> torch.Tensor:
    parts = [lw[k] for k in keys]
    whole = _adjacent(parts)
    if whole is None:
        whole = torch.cat(parts)
    a = 0
    for k, p in zip(keys, parts):
        lw[k] = whole[a:a + p.shape[0]]
        a += p.shape[0]
    return whole


def _adjacent(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor that holds parts back to back (contiguous row slices of one storage), or None."""
    first = parts[0]
    if not all(p.is_contiguous() and p.dtype == first.dtype and p.shape[1:] == first.shape[1:] for p in parts):
        return None
    if any(p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for p in parts):
        return None
    off = first.storage_offset()
    for p in parts:
        if p.storage_offset() != off:
            return None
        off += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))


def fused_of(model, layer: int, step) -> dict[str, torch.Tensor]:
    """The fused matrices layer `layer` of a step may use: only a block cache's block step's
    (Fast-dLLM prefix / dual, alone or stacked), whose few rows make the projections' launches
    and split-K reductions count. Elsewhere the separate matrices run: a fused [n, 2F] output
    cannot free its up half to the down projection's output as a separate up buffer does, so a
    full step's FFN peak would grow by n x d (a tiny model's L_max on two ranks fell from 9,216 to
    8,192 tokens). None when the step streams its layers (offload) or under tensor parallelism."""
    return model.fused[layer] if _fused_step(model, step) else {}


def one_pass_norms(model, step) -> bool:
    """Whether a step's RMSNorms run the one-pass kernel (kernels.rmsnorm_kernel, where Triton
    runs): a block step with fused matrices (fused_of) of a model fused with 'all'
    (fused_projections: all, opt-in and labelled: its fp32 sum order is not PyTorch's mean's).
    LLaDA-8B's block step: 65 norms of 3 launches (0.8 ms of a 6.7 ms step on an H200) become 65
    launches."""
    return "qkv" in getattr(model, "fusion", ()) and _fused_step(model, step)


def _fused_step(model, step) -> bool:
    return bool(getattr(model, "fused", None)) and step.offload is None and model.tensor is None \
        and getattr(step.cache, "mode", None) == "block"
