"""LLaDA with Fast-dLLM's accelerations: block K/V caches and parallel commits (opt-in, lossy).

The loops are Fast-dLLM's llada/generate.py (NVlabs/Fast-dLLM; docs/FAST_DECODING.md pins the
version): `generate` (cache none), `generate_with_prefix_cache`, `generate_with_dual_cache`,
each committing by a count schedule, a confidence threshold or the factor rule. Per block:

  cache none     every step is a full step over the canvas (candidates: masks left of the
                 block's end), until the block has no mask
  prefix / dual  the block's first step is a full step that fills the K/V store; its later steps
                 run only rows [block start, L) (prefix) or the block (dual) against the store

Confidence is the float64 softmax probability of the chosen token (or a uniform draw for
remasking='random'), as the published get_transfer_index computes it. Deviations (each in the
docs): a padded batch masks its left padding as LLaDA's reference does; a row with no candidate
commits nothing; a block stops after `block_length` steps (threshold, factor) or its scheduled
steps (counts) even if a committed mask id left it incomplete, where the published loop would
spin or raise."""

from __future__ import annotations

import dataclasses

import torch

from ...errors import InputError
from ...models.kv_cache import CacheStep
from .. import published as P
from ..commit import apply, commit_counts, commit_factor, commit_threshold
from ..reducers import LLaDAReducer, NoiseStream
from ..ties import within
from .base import RowsCall, StepDone, evaluate, starts_of
from .constraint import WINDOW, committed, constraint_of, settle, window
from .fast_common import FastSamplerMixin, check_fast, rule
from .llada import LLaDASampler, scatter_prediction

FAST_OPTIONS = frozenset({"cache", "threshold", "factor"})


class FastLLaDASampler(FastSamplerMixin, LLaDASampler):
    display = "LLaDA (Fast-dLLM)"
    options = LLaDASampler.options | FAST_OPTIONS
    accelerated = True

    def check_own(self, gen, prompt_len: int) -> None:
        super().check_own(gen, prompt_len)
        check_fast(gen, self.display)
        unsupported = [name for name, bad in (("cfg_scale", gen.cfg_scale > 0), ("logits_eos_inf", gen.logits_eos_inf),
                                              ("confidence_eos_eot_inf", gen.confidence_eos_eot_inf)) if bad]
        if unsupported:
            raise InputError(f"{', '.join(unsupported)} cannot be combined with Fast-dLLM decoding (cache, "
                             "threshold, factor): the published accelerated sampler has no such option")

    def uses_cache(self, gen) -> bool:
        return gen.cache != "none"

    def max_steps(self, gen) -> int:
        """The most steps a request can take (the progress bar's total)."""
        blocks, spb = self.blocks(gen)
        bl = gen.block_length or gen.max_new_tokens
        return blocks * (spb if rule(gen) == "counts" else bl)

    def admit_rows(self, gen, length: int) -> int:
        """Masked rows per sequence of the largest step (the block's candidates)."""
        return gen.block_length or gen.max_new_tokens

    def constrained_rows(self, gen, length: int) -> int:
        """The window: the schedule's count (counts), else WINDOW positions of the block."""
        if rule(gen) == "counts":
            return super().constrained_rows(gen, length)
        return min(WINDOW, gen.block_length or gen.max_new_tokens)

    def loop(self, predict, x, prompt_len, gen, generator):
        """Every decision on the device (runtime/commit.py); a step reads back one [3, B] tensor:
        the rows a tie decides, the block's masks left and the step's candidates, per row."""
        blocks, spb = self.blocks(gen)
        bl = gen.block_length or gen.max_new_tokens
        mask_id, L = self.mcfg.mask_id, x.shape[1]
        how = rule(gen)
        bound = spb if how == "counts" else bl    # the most steps a block can use (see docstring)

        C = constraint_of(predict)       # an output constraint: commits from each row's frontier

        def commit(conf, counts_i, a=0):
            s = within(starts_of(predict), a)      # ties ranked from each row's first token
            if how == "threshold":
                return commit_threshold(conf, gen.threshold, s)
            if how == "factor":
                return commit_factor(conf, gen.factor, s)
            return commit_counts(conf, counts_i, s)

        rows_nfe = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)

        def step(view, x0, c, cand, lo, hi, a=0):
            """Commit, count, read back once: (masks left in the block per row, candidates)."""
            rows_nfe.add_(cand.any(1).long())         # a row alone would have run this step
            if C is not None:      # an output constraint: the rule's choice as a run from each row's frontier
                t = settle(C, c.settle(), run=how != "counts", a=a)
                view[t] = x0[t]
                committed(C, x)
                return bool((x[:, lo:hi] == mask_id).any()), StepDone(int(cand.sum()))
            left, masked = apply(view, x0, c, lambda: torch.stack([(x[:, lo:hi] == mask_id).sum(1), cand.sum(1)]))
            return any(left), StepDone(sum(masked))

        for nb in range(blocks):
            lo, hi = prompt_len + nb * bl, prompt_len + (nb + 1) * bl
            counts = P.num_transfer_tokens(x[:, lo:hi] == mask_id, spb)      # [B, spb]
            cand = x == mask_id
            cand[:, hi:] = False
            stop = gen.threshold if how == "threshold" else None     # a walk may stop below it (constraint.py)
            cand = window(C, cand, counts[:, 0] if how == "counts" else None, stop=stop)
            x0, conf = yield from evaluate(predict(x, 0, L, cand, "fill" if gen.cache != "none" else None))
            masks_left, event = step(x, x0, commit(conf, counts[:, 0]), cand, lo, hi)  # (counts: the schedule's)
            yield event
            a, b = (lo, L) if gen.cache == "prefix" else (lo, hi) if gen.cache == "dual" else (0, L)
            i = 1
            while masks_left and i < bound:
                k = counts[:, i] if how == "counts" else None
                if gen.cache == "none":
                    cand = x == mask_id
                    cand[:, hi:] = False
                    x0, conf = yield from evaluate(predict(x, 0, L, window(C, cand, k, stop=stop), None))
                else:
                    cand = x[:, a:b] == mask_id
                    cand[:, hi - a:] = False
                    cand = window(C, cand, k, a, stop)
                    x0, conf = yield from evaluate(predict(x, a, b, cand, "block", extra_noise=gen.cache == "prefix"))
                masks_left, event = step(x[:, a:b], x0, commit(conf, k, a), cand, lo, hi, a)
                yield event
                i += 1
        return {"row_nfe": rows_nfe.tolist()}

    def planned_predict(self, gen, generator):
        """predict(x, a, b, cand [B, b-a], mode, extra_noise) -> (x0, conf) [B, b-a]: the
        candidates' tokens and confidences over canvas rows [a, b) (-inf elsewhere), from a
        plain step (mode None), a store fill or a block step."""
        mcfg = self.mcfg
        gen64 = dataclasses.replace(gen, confidence_dtype="float64", cache="none", threshold=None, factor=None)

        def predict(x, a, b, cand, mode, extra_noise=False):
            B, n = x.shape[0], b - a
            if extra_noise and gen.temperature > 0 and x.device.type != "cuda":
                # the published prefix loop draws one Gumbel noise tensor it never uses
                NoiseStream(B * n, mcfg.vocab, generator, x.device).finish()
            rows = cand.reshape(-1).nonzero().squeeze(1)                       # [M] of the B*n rows
            reducer = LLaDAReducer(mcfg, gen64, rows, B * n, generator, x.device)
            spec = None if mode is None else CacheStep(mode, a, b, x.shape[1])
            outs = yield RowsCall(x, rows, None, reducer, cache=spec)
            reducer.finish()
            return scatter_prediction(x[:, a:b], rows, outs, gen.remasking, generator, torch.float64)
        return predict

