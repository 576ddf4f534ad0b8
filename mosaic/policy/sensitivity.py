"""How much each layer minds FP8: sensitivity scores from calibration canvases (docs/FP8.md).

Two measures, both computed on the model as loaded (16-bit weights) with FP8 emulated exactly
where it runs on a CPU (kernels/fp8.py):
  kl     end to end: quantize one layer alone, run the native forward, and take the mean KL
         divergence KL(p_16 || p_8) of the predicted distributions at the masked positions
         (L + 1 forward passes; the measure the chooser's total is meant to bound).
  local  per layer, the relative output error sum over its matrices of
         ||x W^T - deq(q(x)) deq(q(W))^T||^2 / ||x W^T||^2 on the inputs the 16-bit model
         actually feeds it (one forward pass): a cheap proxy in the spirit of the layer-wise
         output-error objectives of GPTQ/OBQ (Frantar et al. 2022), used when L forward passes
         are too many.
Calibration canvases: for the bundled task models, task prompts (not the held-out set) with
their answers partly masked, as in the denoising loop's later steps; otherwise random ids with
the second half masked.
"""

from __future__ import annotations

import random

import torch

from ..assets import tasks
from ..graph.ctx import EagerCtx
from ..kernels import fp8 as FP8
from ..models.layers import step_program
from ..models.precision import quantizable, quantize_layer
from ..models.step import make_step
from ..runtime.runner import NativeRunner

TASK_MODELS = ("tiny-llada", "tiny-dream")
CALIBRATION_SEED = 777          # held-out prompts use 12345 (assets/tasks.py)


def calibration_canvases(model, count: int, length: int = 64, seed: int = CALIBRATION_SEED) -> torch.Tensor:
    """[count, L] int64 canvases on the model's device with some positions masked."""
    cfg, g = model.cfg, torch.Generator().manual_seed(seed)
    if model.name in TASK_MODELS and model.tokenizer is not None:
        rng = random.Random(seed)
        rows = []
        for _ in range(count):
            p = tasks.sample(rng, *rng.choice(tasks.shapes()))
            answer = tasks.solve(p)
            ids = model.tokenizer.encode(p) + model.tokenizer.encode(answer)
            ids += [cfg.eos_id] * (len(model.tokenizer.encode(p)) + tasks.ANSWER_LEN - len(ids))
            plen = len(model.tokenizer.encode(p))
            frac = rng.random()                       # later steps: part of the answer revealed
            for j in range(plen, len(ids)):
                if j == plen or rng.random() < frac:
                    ids[j] = cfg.mask_id
            rows.append(ids)
        width = max(len(r) for r in rows)
        x = torch.full((count, width), cfg.mask_id, dtype=torch.long)
        for i, r in enumerate(rows):                   # right-pad with masks: still a valid canvas
            x[i, : len(r)] = torch.tensor(r)
        return x.to(model.device)
    hi = max(1, min(cfg.vocab, cfg.mask_id) - 1)
    x = torch.randint(0, hi, (count, length), generator=g)
    x[:, length // 2:] = cfg.mask_id
    return x.to(model.device)


def _masked_logprobs(model, canvases: torch.Tensor) -> torch.Tensor:
    logits = NativeRunner(model).forward(canvases, None)
    return torch.log_softmax(logits[canvases == model.cfg.mask_id].float(), dim=-1)   # [M, V]


def kl_sensitivity(model, canvases: torch.Tensor) -> list[float]:
    """Per layer: mean KL(p_16 || p_8) over masked positions with that layer alone in FP8."""
    with torch.no_grad():
        ref = _masked_logprobs(model, canvases)
        out = []
        for i, lw in enumerate(model.layers):
            model.layers[i] = quantize_layer(lw)
            try:
                lq = _masked_logprobs(model, canvases)
            finally:
                model.layers[i] = lw
            out.append(float((ref.exp() * (ref - lq)).sum(-1).mean()))
    return out


class _Capture(EagerCtx):
    """An eager context that scores every 16-bit linear by its FP8 relative output error."""

    def __init__(self, model, **kw):
        super().__init__(model.device, model.dtype, **kw)
        self.keys = {id(w): i for i, lw in enumerate(model.layers) for k, w in lw.items()
                     if k in quantizable(lw)}
        self.err = [0.0] * len(model.layers)

    def linear(self, name, x, w, b=None, out=None, scale=None, quant=False):
        out = super().linear(name, x, w, b, out)
        layer = self.keys.get(id(w))
        if layer is not None and x.shape[0]:
            w8, sw = FP8.quantize_weight(w)
            x8 = torch.empty(x.shape, dtype=FP8.E4M3, device=x.device)
            sx = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
            FP8.quantize_rows_ref(x8, sx, x)
            y = torch.empty(out.shape, dtype=torch.float32, device=x.device)
            FP8.scaled_mm_emulated(y, x8, sx, w8, sw)
            ref = torch.mm(x.float(), w.float().t())
            self.err[layer] += float((y - ref).pow(2).sum() / ref.pow(2).sum().clamp_min(1e-30))
        return out


def local_sensitivity(model, canvases: torch.Tensor) -> list[float]:
    """Per layer: the summed relative output error of its matrices in FP8 (one forward pass)."""
    with torch.no_grad():
        ctx = _Capture(model)
        step_program(ctx, model, make_step(model.cfg, canvases, None))
    return ctx.err


def layer_sensitivity(model, method: str = "kl", count: int = 16) -> list[float]:
    """Sensitivity per layer (higher: FP8 hurts more) by `method` ('kl' | 'local')."""
    canvases = calibration_canvases(model, count)
    return kl_sensitivity(model, canvases) if method == "kl" else local_sensitivity(model, canvases)
