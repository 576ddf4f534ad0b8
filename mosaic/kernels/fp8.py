"""FP8 (e4m3) weights and activations: quantization, the scaled matmul, and its exact emulation.

Scheme (rowwise scaling, as torch._scaled_mm supports on Hopper):
  weight  W [out, in]  -> W8 = e4m3(W / s_w), s_w [out] fp32 = amax(|W[o, :]|) / 448
  input   x [n, in]    -> x8 = e4m3(x / s_x), s_x [n]   fp32 = amax(|x[r, :]|) / 448   (per token,
                          computed at run time: "dynamic" activation scales)
  output  y [n, out]   = round_to_out_dtype((x8 @ W8^T) * s_x[:, None] * s_w[None, :]) (+ bias)
The 448 is e4m3fn's largest finite value; a row of zeros gets scale 1 (its e4m3 codes are 0).
Division (not multiplication by a reciprocal) and round-to-nearest-even into e4m3, with values
clamped to +-448 first, in both the PyTorch reference and the Triton kernel: their codes and
scales agree bit for bit. On a GPU the product runs in torch._scaled_mm (fp32 accumulation on the
tensor cores); on a CPU it is emulated: the e4m3 codes widened to fp32, one fp32 matmul, the
same scale epilogue (docs/FP8.md). Source: the rowwise FP8 recipe of torchao / PyTorch's
_scaled_mm tests; e4m3 format from Micikevicius et al. 2022, "FP8 formats for deep learning".
"""

from __future__ import annotations

import torch

from . import want_triton

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scales from fp32 row maxima: amax / 448, and 1 where amax is 0 (or not finite)."""
    s = amax / E4M3_MAX
    return torch.where((amax > 0) & torch.isfinite(amax), s, torch.ones_like(s))


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] (any float dtype) -> (W8 [out, in] e4m3, s_w [out] fp32), per output channel.
    Works on meta tensors (capacity planning) and row by row blocks to bound fp32 temporaries."""
    out = torch.empty(w.shape, dtype=E4M3, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    if w.device.type == "meta":
        return out, scale
    step = max(1, (1 << 24) // max(1, w.shape[1]))        # 64 MiB of fp32 at a time
    for a in range(0, w.shape[0], step):
        wf = w[a:a + step].float()
        s = scale_of(wf.abs().amax(dim=1))
        scale[a:a + step] = s
        out[a:a + step] = (wf / s[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return out, scale


def dequantize(w8: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """e4m3 codes [r, c] times their row scales [r] -> dtype [r, c] (tests, the embedding)."""
    return (w8.float() * scale[:, None]).to(dtype)


def quantize_rows_ref(x8: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> None:
    """x [n, d] -> x8 [n, d] e4m3 and scale [n] fp32 (per row), into the given buffers; fp32
    temporaries of at most 4096 rows. The Triton kernel's oracle."""
    for a in range(0, x.shape[0], 4096):
        xf = x[a:a + 4096].float()
        s = scale_of(xf.abs().amax(dim=1))
        scale[a:a + 4096] = s
        x8[a:a + 4096] = (xf / s[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_rows(x8: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, setting: str = "auto") -> None:
    """Per-row dynamic quantization of activations, one pass over x (the Triton kernel on CUDA,
    the PyTorch reference otherwise; same codes and scales)."""
    if x.shape[0] == 0:
        return
    if want_triton(x.device.type, setting):
        from . import fp8_triton
        fp8_triton.quantize_rows(x8, scale, x)
    else:
        quantize_rows_ref(x8, scale, x)


def scaled_mm_emulated(out: torch.Tensor, x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor,
                       sw: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """The FP8 product on any device: e4m3 codes are exact in fp32, so one fp32 matmul and the
    scale epilogue give what the tensor cores compute up to fp32 summation order."""
    acc = torch.mm(x8.float(), w8.float().t())
    acc.mul_(sx[:, None]).mul_(sw[None, :])
    if bias is not None:
        acc.add_(bias.float())
    out.copy_(acc)


def scaled_mm(out: torch.Tensor, x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor,
              sw: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """out [n, o] (bf16 or fp16 on CUDA; any float dtype emulated) = x8 [n, i] @ w8 [o, i]^T with
    row scales sx [n] and column scales sw [o], plus bias [o]. torch._scaled_mm on CUDA (rowwise
    scaling needs sm_89+, i, o multiples of 16, out_dtype bf16); emulated elsewhere."""
    if out.device.type != "cuda":
        scaled_mm_emulated(out, x8, sx, w8, sw, bias)
        return
    if x8.shape[0] == 0:
        return
    torch._scaled_mm(x8, w8.t(), scale_a=sx[:, None], scale_b=sw[None, :], bias=bias,
                     out_dtype=out.dtype, out=out)


def cuda_fp8_error(device: torch.device) -> str | None:
    """Why FP8 matmuls cannot run on this device (None when they can): rowwise-scaled
    torch._scaled_mm needs compute capability 8.9 or newer."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"FP8 weights need a GPU of compute capability 8.9+ (Ada, Hopper); this one is {major}.{minor}"
    return None
