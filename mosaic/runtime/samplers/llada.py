"""LLaDA's sampler: semi-autoregressive blocks, low-confidence or random remasking, cfg.

The loop is the published one (GSAI-ML/LLaDA, generate.py); `predict` gives, for the current
canvas, the candidate token and confidence of every position ([B, L] each, -inf where a position
cannot be chosen). The native path computes them from full logits, the planned path from masked
rows only. Used for dense LLaDA and LLaDA-MoE."""

from __future__ import annotations

import torch

from ...errors import InputError
from .. import published as P
from ..commit import apply, commit_counts
from ..reducers import LLaDAReducer
from .base import LogitsCall, RowsCall, Sampler, StepDone, evaluate, starts_of
from .constraint import committed, constraint_of, settle, window


class LLaDASampler(Sampler):
    family = "llada"
    display = "LLaDA"
    options = frozenset({"block_length", "cfg_scale", "remasking", "confidence_dtype",
                         "logits_eos_inf", "confidence_eos_eot_inf"})

    def blocks(self, gen) -> tuple[int, int]:
        """(number of blocks, steps per block)."""
        n, bl = gen.max_new_tokens, gen.block_length or gen.max_new_tokens
        return n // bl, self.total_steps(gen) // (n // bl)

    def steps_unit(self, gen) -> int:
        n, bl = gen.max_new_tokens, gen.block_length or gen.max_new_tokens
        fits = isinstance(n, int) and isinstance(bl, int) and bl > 0 and n % bl == 0
        return n // bl if fits else 1     # a block that does not divide the canvas: check_own names it

    def check_own(self, gen, prompt_len: int) -> None:
        n, bl = gen.max_new_tokens, gen.block_length or gen.max_new_tokens
        steps = self.total_steps(gen)
        if bl <= 0 or n % bl:
            raise InputError(f"gen_length {n} is not divisible by block_length {bl}; "
                             f"divisors of {n}: {[d for d in range(1, n + 1) if n % d == 0][:12]}")
        blocks = n // bl
        if steps % blocks:
            raise InputError(f"steps {steps} must be a positive multiple of the number of blocks "
                             f"({blocks} = gen_length {n} / block_length {bl})")
        if gen.remasking not in ("low_confidence", "random"):
            raise InputError(f"remasking {gen.remasking!r}: use 'low_confidence' or 'random'")
        if gen.confidence_dtype not in ("model", "float64"):
            raise InputError(f"confidence_dtype {gen.confidence_dtype!r}: use 'model' or 'float64'")
        if gen.cfg_scale < 0:
            raise InputError(f"cfg_scale must be >= 0, got {gen.cfg_scale}")
        m = self.mcfg
        if (gen.logits_eos_inf or gen.confidence_eos_eot_inf) and m.eos_id is None:
            raise InputError("logits_eos_inf / confidence_eos_eot_inf need the end-of-text token id, and this "
                             "model's config.json has none (eos_token_id); add it, or leave the options off")
        if gen.confidence_eos_eot_inf and m.eot_id is None:
            raise InputError("confidence_eos_eot_inf needs the end-of-turn token id, and this model's config.json "
                             "has none (eot_token_id; LLaDA-MoE's published config has none): add it to "
                             "config.json, or leave the option off")

    def first_masked(self, gen) -> int:
        # positions right of the current block are never candidates: only one block's logits
        return gen.block_length or gen.max_new_tokens

    def constrained_rows(self, gen, length: int) -> int:
        # the window is the step's count: a block's masks split over its steps, the first ones one more
        bl = gen.block_length or gen.max_new_tokens
        return -(-bl // self.blocks(gen)[1])

    def cfg_pair(self, gen) -> bool:
        return gen.cfg_scale > 0

    def draws(self, gen) -> bool:
        return gen.temperature > 0 or gen.remasking == "random"

    def loop(self, predict, x, prompt_len, gen, generator):
        blocks, steps = self.blocks(gen)
        bl = gen.block_length or gen.max_new_tokens
        mask_id = self.mcfg.mask_id
        prompt_index = x != mask_id
        C = constraint_of(predict)       # an output constraint: commits from each row's frontier
        for nb in range(blocks):
            lo, hi = prompt_len + nb * bl, prompt_len + (nb + 1) * bl
            counts = P.num_transfer_tokens(x[:, lo:hi] == mask_id, steps)   # [B, steps]
            for i in range(steps):
                mask_index = x == mask_id
                cand = window(C, mask_index, counts[:, i])
                x0, confidence = yield from evaluate(predict(x, cand, hi, prompt_index))
                # the published per-row torch.topk, on the device (runtime/commit.py); one readback
                c = commit_counts(confidence, counts[:, i], starts_of(predict))
                if C is None:
                    masked = apply(x, x0, c, lambda: mask_index.sum(1)[None])[0]
                    yield StepDone(sum(masked))
                    continue
                transfer = settle(C, c.settle())     # an output constraint: from each row's frontier
                x[transfer] = x0[transfer]
                committed(C, x)
                yield StepDone(int(mask_index.sum()))
        return {}

    def one_step(self, predict, x):
        mask_index = x == self.mcfg.mask_id
        return (yield from evaluate(predict(x, mask_index, x.shape[1], ~mask_index)))

    def native_predict(self, gen, generator, valid):
        """The published step on full logits [B, L, V] (a LogitsCall per forward)."""
        mcfg = self.mcfg

        def predict(x, mask_index, right, prompt_index):
            if gen.cfg_scale > 0:
                un_x = x.clone()
                un_x[prompt_index] = mcfg.mask_id
                both = yield LogitsCall(torch.cat([x, un_x]), None if valid is None else torch.cat([valid, valid]))
                logits, un_logits = torch.chunk(both, 2, dim=0)
                logits = un_logits + (gen.cfg_scale + 1) * (logits - un_logits)
            else:
                logits = yield LogitsCall(x, valid)
            if gen.logits_eos_inf:
                logits[:, :, mcfg.eos_id] = -torch.inf
            noisy = P.add_gumbel_noise(logits, gen.temperature, generator=generator)
            x0 = torch.argmax(noisy, dim=-1)
            if gen.confidence_eos_eot_inf:
                noisy[:, :, mcfg.eos_id] = logits[:, :, mcfg.eot_id] = -torch.inf
            if gen.remasking == "low_confidence":
                x0_p = P.llada_confidence(logits, x0, gen.confidence_dtype)
            else:
                x0_p = torch.rand(x0.shape, device=x0.device, generator=generator)
            x0_p[:, right:] = -torch.inf
            x0 = torch.where(mask_index, x0, x)
            return x0, torch.where(mask_index, x0_p, -torch.inf)
        return predict

    def planned_predict(self, gen, generator):
        """The same step from masked rows only. Positions right of the current block get -inf in
        the reference and can never be chosen, so their logits are not computed at all."""
        mcfg = self.mcfg

        def predict(x, mask_index, right, prompt_index):
            B, L = x.shape
            cand = mask_index.clone()
            cand[:, right:] = False
            rows = cand.reshape(-1).nonzero().squeeze(1)                       # [M] flattened
            ids, rows_u = x, None
            if gen.cfg_scale > 0:
                un_x = x.clone()
                un_x[prompt_index] = mcfg.mask_id
                ids, rows_u = torch.cat([x, un_x]), rows + B * L
            reducer = LLaDAReducer(mcfg, gen, rows, B * L, generator, x.device)
            outs = yield RowsCall(ids, rows, rows_u, reducer)
            reducer.finish()
            return scatter_prediction(x, rows, outs, gen.remasking, generator)
        return predict

    def lossy_labels(self, gen, device, native):
        if not native and gen.temperature > 0 and device.type == "cuda":
            return ["gumbel-stream: GPU random draws differ from the reference's stream"]
        return []


def scatter_prediction(x: torch.Tensor, rows: torch.Tensor, outs: dict, remasking: str, generator,
                       conf_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x0, conf) [B, n] over the canvas slice x [B, n]: x with the predicted tokens at the M
    flat `rows`, and their confidences there (-inf elsewhere): the reducer's (cast to
    conf_dtype if given) for low_confidence, else one uniform draw per position as the
    published random remasking does (drawn for every position, so the stream matches it)."""
    B, n = x.shape
    x0 = x.clone().reshape(-1)
    x0[rows] = outs["x0"]
    if remasking == "low_confidence":
        got = outs["conf"] if conf_dtype is None else outs["conf"].to(conf_dtype)
        conf = torch.full((B * n,), -torch.inf, dtype=got.dtype, device=x.device)
        conf[rows] = got
    else:
        x0_p = torch.rand((B, n), device=x.device, generator=generator).reshape(-1)
        conf = torch.full_like(x0_p, -torch.inf)
        conf[rows] = x0_p[rows]
    return x0.view(B, n), conf.view(B, n)
