"""The per-step math of the block-diffusion sampler (block_diffusion.py), on [B, block] tensors:
tokens and their probabilities as the published _sample_with_temperature_topk_topp computes them
(with its random stream), and LLaDA2.1's token-to-token edits (its fill is LLaDA2's rule,
runtime/commit.py).

Random stream: the published code draws `torch.multinomial(probs, 1)` over every row of the
block ([B * block, V], prompt and committed rows included) from the global generator. So at
temperature > 0 the sampler predicts every row of the block and the reducer makes that one call
(the rows the rule does not read are dropped): the published tokens, and the generator left where
the published call leaves it. Inside a captured CUDA graph the same draw runs without
multinomial's host-side checks (published.multinomial_one: argmax(probs / q), q ~ Exp(1) drawn by
exponential_ over the probabilities, ATen's one-sample path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import published as P


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
    the logits' dtype (SDAR). At temperature > 0 one multinomial draw over the chunk's rows from
    `generator` (None: the device's default, as the published code draws)."""

    def __init__(self, gen, generator=None, fp32: bool = True):
        self.g, self.generator, self.fp32 = gen, generator, fp32

    def subset(self, idx):
        return self

    def with_generator(self, generator):
        return BlockReducer(self.g, generator, self.fp32)

    @property
    def draws(self) -> bool:
        return self.g.temperature > 0

    def capture_problem(self, fused: bool) -> str | None:
        return None

    @property
    def one_row_scan(self) -> bool:
        """top-p's cumsum: its bits over one row differ from a padded step's (runtime/graphs.py)."""
        return self.g.top_p is not None and self.g.top_p < 1

    def draw_calls(self, m: int, V: int, dtype, fused: bool):
        """torch.multinomial's exponential draws over the chunk's probabilities."""
        return [("exponential", m * V, torch.float32 if self.fp32 else dtype)] if self.draws else []

    def outputs(self, dtype):
        # ok: False where torch.multinomial would have refused the probabilities (runtime/graphs.py)
        return [("x0", torch.int64), ("conf", torch.float32)] + ([("ok", torch.bool)] if self.draws else [])

    fused = None

    def signature(self):
        return ("block", self.g.temperature > 0, self.g.top_k, self.g.top_p, self.fp32)

    def row_math(self):
        """What a row's result depends on besides its logits (None: a random stream of its own):
        at temperature 0 only the logits' dtype, so stacked requests reduce as one
        (engine/batching.StackedReducer)."""
        return None if self.g.temperature > 0 else ("block", self.fp32)

    def transient_bytes(self, m, V, dtype) -> int:
        # the (float32) logits and their softmax; sampling adds filtered copies, the top-p sort's
        # values and int64 ids, its cumulative sum and masks, and multinomial's noise
        return m * V * 4 * 2 + (m * V * (4 * 5 + 8 + 2) if self.g.temperature > 0 else 0)

    def __call__(self, lg, lu, a, b, outs):
        g = self.g
        logits = lg.float() if self.fp32 else lg
        if g.temperature == 0:
            x0 = logits.argmax(dim=-1, keepdim=True)
            probs = F.softmax(logits, dim=-1)
        else:
            probs = F.softmax(filtered_logits(logits, g.temperature, g.top_k, g.top_p), dim=-1)
            if P.capturing():   # the same draws without multinomial's host-side checks
                x0, ok = P.multinomial_one(probs, self.generator)
                outs["ok"].copy_(ok.expand(outs["ok"].shape))
            else:
                x0 = torch.multinomial(probs, num_samples=1, generator=self.generator)
                outs["ok"].fill_(True)
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
