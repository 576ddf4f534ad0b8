"""The per-step math of the block-diffusion sampler (block_diffusion.py), on [B, block] tensors:
tokens and their probabilities as the published _sample_with_temperature_topk_topp computes them
(with its random stream), and LLaDA2.1's token-to-token edits (its fill is LLaDA2's rule,
runtime/commit.py).

Random stream: the published code draws `torch.multinomial(probs, 1)` over every row of the
block ([B * block, V], prompt and committed rows included) from the global generator. For one
sample PyTorch draws it as argmax(probs / q) with q = empty_like(probs).exponential_(generator)
(ATen's multinomial one-sample path; measured equal on the CPU, stream position after the call
included). So the sampler draws q for every row of the block in one call, in the published
order, and each predicted row takes argmax(probs / q[its block row]): the published tokens for
the rows it keeps, and the generator left where the published call leaves it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block_noise(rows: int, vocab: int, dtype: torch.dtype, generator, device) -> torch.Tensor:
    """Exponential(1) noise [rows, V] in `dtype` (the probabilities' dtype), one call."""
    return torch.empty(rows, vocab, dtype=dtype, device=device).exponential_(generator=generator)


def filtered_logits(logits: torch.Tensor, temperature: float, top_k, top_p) -> torch.Tensor:
    """logits [m, V] / temperature, then top-k, then top-p, as the published helpers (-inf out)."""
    if temperature != 1.0:
        logits = logits / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]))[0][..., -1, None]
        logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
    if top_p is not None and top_p < 1.0:
        srt, order = torch.sort(logits, descending=True)
        drop = torch.cumsum(F.softmax(srt, dim=-1), dim=-1) > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, drop),
                                    float("-inf"))
    return logits


class BlockReducer:
    """Per predicted row: x0 and its probability, as _sample_with_temperature_topk_topp computes
    them. fp32: from the logits cast to float32 (LLaDA2's forward returns logits.float()), else in
    the logits' dtype (SDAR). noise [R, V] (block_noise, temperature > 0) and noise_rows [M]: the
    block row of each predicted row. draw_rows: the rows drawn per step (charged while planning
    when no noise is given)."""

    def __init__(self, gen, noise: torch.Tensor | None = None, noise_rows: torch.Tensor | None = None,
                 fp32: bool = True, draw_rows: int = 0):
        self.g, self.noise, self.noise_rows, self.fp32 = gen, noise, noise_rows, fp32
        self.draw_rows = draw_rows if noise is None else int(noise.shape[0])

    def subset(self, idx):
        return self

    def outputs(self, dtype):
        return [("x0", torch.int64), ("conf", torch.float32)]

    fused = None

    def signature(self):
        return ("block", self.g.temperature > 0, self.g.top_k, self.g.top_p, self.fp32)

    def transient_bytes(self, m, V, dtype) -> int:
        # the (float32) logits and their softmax; sampling adds filtered copies, the top-p sort's
        # values and int64 ids, its cumulative sum and masks, and the step's noise
        item = 4 if self.fp32 else dtype.itemsize
        sampled = m * V * (4 * 4 + 8 + 2) + self.draw_rows * V * item if self.g.temperature > 0 else 0
        return m * V * 4 * 2 + sampled

    def __call__(self, lg, lu, a, b, outs):
        g = self.g
        logits = lg.float() if self.fp32 else lg
        if g.temperature == 0:
            x0 = logits.argmax(dim=-1, keepdim=True)
            probs = F.softmax(logits, dim=-1)
        else:
            probs = F.softmax(filtered_logits(logits, g.temperature, g.top_k, g.top_p), dim=-1)
            x0 = (probs / self.noise[self.noise_rows[a:b]]).argmax(dim=-1, keepdim=True)
        outs["x0"].copy_(x0[:, 0])
        outs["conf"].copy_(torch.gather(probs, -1, x0)[:, 0])

    def finish(self):
        pass


def edits(x0: torch.Tensor, conf: torch.Tensor, old: torch.Tensor, editable: torch.Tensor,
          threshold: float) -> torch.Tensor:
    """LLaDA2.1's token-to-token edits, [B, block] bool: filled, non-prompt positions whose new
    prediction differs from their token with probability > threshold."""
    return (conf > threshold) & editable & (x0 != old)


def stop_ids(gen, mcfg, every_eos: bool) -> torch.Tensor:
    """The end-of-text ids a sequence stops at: the request's eos_id, else the model's eos_id
    (and, every_eos, its other end-of-text ids: SDAR's stopping_criteria_idx)."""
    if gen.eos_id is not None:
        return torch.tensor([gen.eos_id])
    return torch.tensor([mcfg.eos_id, *(mcfg.extra_eos_ids if every_eos else ())])
