"""Per-layer weight precision: a layer's matrices as FP8 (e4m3 codes + per-output-channel fp32
scales, kernels/fp8.py) or in the model dtype. Opt-in and lossy (docs/FP8.md).

A quantized layer keeps its dict of tensors: each matrix key (q, k, v, o, gate, up, down) holds
the e4m3 codes [out, in] and `<key>_scale` its scales [out]; norms and biases stay in the model
dtype. layers.py multiplies through ctx.linear's FP8 path whenever a scale is present. MoE
experts (their own loop outside ctx.linear) and the router stay in the model dtype: in a MoE
model only the attention matrices can be FP8.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from ..kernels import fp8 as FP8

MATRICES = ("q", "k", "v", "o", "gate", "up", "down")
FP8_NAME = "fp8"


def quantizable(lw: dict) -> list[str]:
    """The keys of a layer that FP8 applies to (2-D matrices, not the MoE router or experts)."""
    return [k for k in MATRICES if k in lw and lw[k].dim() == 2]


def quantize_layer(lw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A new layer dict with every quantizable matrix as e4m3 codes + `<key>_scale`; the other
    tensors are the same objects. A layer already in FP8 is returned as is."""
    if any(k.endswith("_scale") for k in lw):
        return lw
    out = {}
    for k, t in lw.items():
        if k in quantizable(lw):
            out[k], out[k + "_scale"] = FP8.quantize_weight(t)
        else:
            out[k] = t
    return out


def layer_bytes_as(lw: dict[str, torch.Tensor], dtype: str) -> int:
    """Bytes of a layer's weights in `dtype` ('fp8' or 'model'), without converting it."""
    total = 0
    for k, t in lw.items():
        if k.endswith("_scale"):
            continue
        if dtype == FP8_NAME and k in quantizable(lw):
            total += t.numel() + 4 * t.shape[0]            # e4m3 codes + fp32 scales
        else:
            total += t.numel() * (t.element_size() if t.dtype != FP8.E4M3 else 2)
    return total


def apply_precision(model, dtypes: list[str]) -> None:
    """Convert, in place, the layers whose entry in `dtypes` is 'fp8' (one per layer; 'model'
    keeps a layer as it is). Converting back is not possible: the 16-bit weights are released.
    Raises InputError when the list does not match the model's depth or a layer is already FP8
    but asked to stay 16-bit."""
    if len(dtypes) != len(model.layers):
        raise InputError(f"precision for {len(dtypes)} layers, but {model.name} has {len(model.layers)}")
    for i, dt in enumerate(dtypes):
        is_fp8 = any(k.endswith("_scale") for k in model.layers[i])
        if dt == FP8_NAME:
            model.layers[i] = quantize_layer(model.layers[i])
        elif is_fp8:
            raise InputError(f"layer {i} is already FP8; its 16-bit weights are gone (reload the model)")
    model.set_precision([FP8_NAME if any(k.endswith("_scale") for k in lw) else _dtype_name(model.dtype)
                         for lw in model.layers], fp8_name=FP8_NAME)


def quantize_embedding(model) -> None:
    """The embedding table as e4m3 codes with one fp32 scale per row (token), in place; the
    step program dequantizes the rows it gathers. Refused for a tied LM head (the fused logits
    kernel reads the head in the model dtype)."""
    if "embed_scale" in model.extra:
        return
    if model.lm_head is model.embed:
        raise InputError(f"{model.name} ties its LM head to the embedding: the embedding cannot be FP8")
    model.set_embedding(*FP8.quantize_weight(model.embed))


def embed_bytes_as(model, dtype: str) -> int:
    """Bytes of the embedding table in `dtype` ('fp8' or 'model')."""
    V, d = model.embed.shape
    return V * d + 4 * V if dtype == FP8_NAME else V * d * model.embed.element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


def ranges(dtypes: list[str]) -> list[dict]:
    """Runs of equal precision, the YAML form: [{'layers': [0, 3], 'dtype': 'bf16'}, ...]."""
    out: list[dict] = []
    for i, dt in enumerate(dtypes):
        if out and out[-1]["dtype"] == dt:
            out[-1]["layers"][1] = i
        else:
            out.append({"layers": [i, i], "dtype": dt})
    return out
