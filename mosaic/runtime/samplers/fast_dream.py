"""Dream with Fast-dLLM's accelerations (opt-in, lossy): its two published loops.

cache prefix / dual (dream/model/generation_utils_block.py, `_sample`): per block of
block_length, one full step fills the K/V store and commits the block's first position
(whatever its confidence); then block steps run rows [start, L) (prefix) or the block (dual),
their logits shifted right by one inside the rows that ran (the block's first position reads
its own row). With a threshold (the published alg='confidence_threshold') each block step
commits the most confident masked position of the block and every other one at or above the
threshold; without one, the block's remaining steps follow Dream's schedule over steps/blocks
steps, ranked by the request's alg (the published loop always ranks by negative entropy: it
equals alg='entropy', which its evaluation scripts set; maskgit_plus and topk_margin are
Mosaic's extension).

cache none with a threshold (dream/model/generation_utils.py, alg='confidence_threshold'):
full steps over the whole canvas; step i commits up to max_new_tokens/steps positions plus the
ones dropped at the step before (the first always, the others at or above the threshold); when
the last step drops some, steps are added until none is left.

Deviations (docs/FAST_DECODING.md): batches are decided row by row (the published threshold
loops handle row 0 only); left padding follows Dream's reference (positions count real tokens);
the factor rule is Mosaic's extension of the LLaDA rule (cached loop only); a block stops after
block_length steps when a committed mask id left it incomplete."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ...errors import InputError
from ...models.kv_cache import CacheStep
from .. import published as P
from ..commit import Commit, apply, commit_counts, commit_factor, commit_threshold, commit_top_threshold
from ..reducers import DreamReducer
from .base import RowsCall, StepDone, evaluate, starts_of
from .constraint import WINDOW, committed, constraint_of, settle, window
from .dream import DreamSampler
from .fast_common import FastSamplerMixin, check_fast, rule
from .fast_llada import FAST_OPTIONS


def _check_uncached(gen, how: str, n: int, steps: int) -> None:
    """The published uncached threshold loop's constraints (InputError)."""
    if how == "factor":
        raise InputError("factor with Dream needs cache 'prefix' or 'dual' (the published uncached Dream "
                         "loop has a threshold rule only)")
    if gen.block_length is not None:
        raise InputError("block_length with Dream applies to cache 'prefix'/'dual' (the published "
                         "uncached threshold loop has no blocks)")
    if n % steps:
        raise InputError(f"max_new_tokens {n} must be a multiple of steps {steps} for Dream's uncached "
                         "threshold loop (it commits max_new_tokens / steps positions per step)")


class FastDreamSampler(FastSamplerMixin, DreamSampler):
    display = "Dream (Fast-dLLM)"
    options = DreamSampler.options | FAST_OPTIONS | {"block_length"}
    accelerated = True

    def block_len(self, gen) -> int:
        return gen.block_length or gen.max_new_tokens

    def steps_unit(self, gen) -> int:
        n, bl = gen.max_new_tokens, self.block_len(gen)
        fits = gen.cache != "none" and isinstance(n, int) and isinstance(bl, int) and bl > 0 and n % bl == 0
        return n // bl if fits else 1     # uncached: no blocks

    def check_own(self, gen, prompt_len: int) -> None:
        super().check_own(gen, prompt_len)
        check_fast(gen, self.display)
        n, bl, steps = gen.max_new_tokens, self.block_len(gen), self.total_steps(gen)
        how = rule(gen)
        if how != "counts" and gen.alg != "maskgit_plus":
            raise InputError(f"alg {gen.alg!r} with a {how}: Fast-dLLM's parallel Dream decoding compares "
                             "the token's probability (alg 'maskgit_plus')")
        if gen.cache == "none":
            _check_uncached(gen, how, n, steps)
            return
        if bl <= 0 or n % bl:
            raise InputError(f"max_new_tokens {n} is not divisible by block_length {bl}; "
                             f"divisors of {n}: {[d for d in range(1, n + 1) if n % d == 0][:12]}")
        if steps % (n // bl):
            raise InputError(f"steps {steps} must be a multiple of the number of blocks ({n // bl} = "
                             f"max_new_tokens {n} / block_length {bl})")
        if how == "counts":
            if steps // (n // bl) < 2:
                raise InputError(f"steps per block must be >= 2 for cached Dream without a threshold (here "
                                 f"{steps // (n // bl)}): its first step commits one position and the published "
                                 "loop stops after steps/blocks steps, leaving the block masked")
            if gen.alg == "origin":
                raise InputError("alg 'origin' has no confidence to rank by; cached Dream without a threshold "
                                 "uses 'entropy' (published), 'maskgit_plus' or 'topk_margin'")

    def uses_cache(self, gen) -> bool:
        return gen.cache != "none"

    def max_steps(self, gen) -> int:
        n, bl = gen.max_new_tokens, self.block_len(gen)
        return n if gen.cache == "none" else (n // bl) * max(bl, self.total_steps(gen) // (n // bl))

    def admit_rows(self, gen, length: int) -> int:
        """Rows of the largest step: the fill samples every position at temperature > 0."""
        if gen.cache != "none" and gen.temperature > 0:
            return length
        return gen.max_new_tokens

    def constrained_rows(self, gen, length: int) -> int:
        """The window: WINDOW positions of the block (threshold, factor), the block schedule's
        largest count (counts, after the fill's one position), every masked position of the
        uncached threshold loop (its per-row quota and carry-over: the unconstrained bound)."""
        if gen.cache == "none":
            return self.admit_rows(gen, length)
        bl = self.block_len(gen)
        if rule(gen) != "counts":
            return min(WINDOW, bl)
        spb = self.total_steps(gen) // (gen.max_new_tokens // bl)
        timesteps = torch.linspace(1, gen.eps, spb + 1)
        most, left = 1, bl - 1
        for i in range(1, spb):
            k = P.dream_transfer_count(torch.tensor(left / 1.0), timesteps[i], timesteps[i + 1], i == spb - 1)
            most, left = max(most, k), left - max(k, 0)
        return min(most, bl)

    def loop(self, predict, x, prompt_len, gen, generator):
        if gen.cache == "none":
            return (yield from self._loop_uncached(predict, x, gen))
        n, bl, mask_id, L = gen.max_new_tokens, self.block_len(gen), self.mcfg.mask_id, x.shape[1]
        blocks = n // bl
        spb = self.total_steps(gen) // blocks
        timesteps = torch.linspace(1, gen.eps, spb + 1, device=x.device)
        how = rule(gen)
        plain = dataclasses.replace(gen, alg="maskgit_plus")   # probability: the fill, threshold, factor
        bound = spb if how == "counts" else bl                  # the most steps a block can use
        B = x.shape[0]
        rows_nfe = torch.zeros(B, dtype=torch.long, device=x.device)
        C = constraint_of(predict)       # an output constraint: commits from each row's frontier
        for nb in range(blocks):
            lo, hi = prompt_len + nb * bl, prompt_len + (nb + 1) * bl
            # fill: every position sampled (their random draws), the block's first one committed
            first = torch.zeros_like(x, dtype=torch.bool).index_fill_(1, torch.tensor([lo], device=x.device), True)
            sample = window(C, first & (x == mask_id), [1] * B) if C is not None else \
                torch.ones_like(x, dtype=torch.bool) if gen.temperature > 0 else first
            _, x0 = yield from evaluate(predict(x, 0, L, sample, "fill", plain))
            if C is None:
                x[:, lo] = x0[:, lo]
                yield StepDone(B * (L if gen.temperature > 0 else 1))
            else:                        # rows whose answer already ended keep their end-of-text
                x[sample] = x0[sample]
                committed(C, x)
                yield StepDone(int(sample.sum()))
            rows_nfe += 1
            a, b = (lo, L) if gen.cache == "prefix" else (lo, hi)
            left = (x[:, lo:hi] == mask_id).any().tolist()     # the block's masks: one read
            i = 1
            while left and i < bound:
                masked = x[:, a:b] == mask_id
                block = masked.clone()
                block[:, bl:] = False
                sample = masked if how != "counts" and gen.temperature > 0 else block
                if C is not None:
                    k = P.dream_transfer_count(block.sum() / B, timesteps[i], timesteps[i + 1], i == spb - 1)
                    block = sample = window(C, block, [k] * B if how == "counts" else None, a,
                                            gen.threshold if how == "threshold" else None)
                conf, x0 = yield from evaluate(predict(x, a, b, sample, "block", gen if how == "counts" else plain))
                conf = conf.masked_fill(~block, -torch.inf)
                c = self._commit(conf, how, gen, generator, block, timesteps[i], timesteps[i + 1], i == spb - 1)
                rows_nfe += block.any(1).long()    # a row alone would have run this step
                if C is None:
                    got = apply(x[:, a:b], x0, c, lambda: torch.stack([(x[:, lo:hi] == mask_id).sum(1), sample.sum(1)]))
                    left = any(got[0])
                    yield StepDone(sum(got[1]))
                else:            # an output constraint: the rule's choice as a run from each row's frontier
                    t = settle(C, c.settle() & block, run=how != "counts", a=a)
                    x[:, a:b][t] = x0[t]
                    committed(C, x)
                    left = bool((x[:, lo:hi] == mask_id).any())
                    yield StepDone(int(sample.sum()))
                i += 1
        return {"row_nfe": rows_nfe.tolist()}

    @staticmethod
    def _commit(conf, how: str, gen, generator, block, t, s, last: bool) -> Commit:
        """A block step's commit on the device (runtime/commit.py): the threshold or factor rule
        per row, or Dream's schedule over the block (its batched torch.topk; alg_temp draws)."""
        if how == "threshold":
            return commit_threshold(conf, gen.threshold)
        if how == "factor":
            return commit_factor(conf, gen.factor)
        B = conf.shape[0]
        if not gen.alg_temp:
            return commit_counts(conf, P.dream_transfer_tensor(block.sum() / B, t, s, last), batched=True)
        k = P.dream_transfer_count(block.sum() / B, t, s, last)
        mask = torch.zeros_like(conf, dtype=torch.bool)
        if k > 0:
            idx = torch.multinomial(F.softmax(conf / gen.alg_temp, dim=-1), num_samples=k, generator=generator)
            mask.scatter_(1, idx, True)
        return Commit(mask, torch.zeros(B, dtype=torch.bool, device=conf.device), lambda rows: mask[rows])

    def _loop_uncached(self, predict, x, gen):
        """generation_utils.py's confidence_threshold loop, every row at once on the device
        (published: batch 1): per row its quota, the positions the step before dropped and the
        index of its last step; one readback per step (that last step, the masked count)."""
        mask_id = self.mcfg.mask_id
        steps = self.total_steps(gen)
        quota = (x == mask_id).sum(1) // steps
        left = torch.zeros_like(quota)
        last = torch.full_like(quota, steps - 1)     # the step index that is each row's last
        plain = dataclasses.replace(gen, alg="maskgit_plus")
        C = constraint_of(predict)       # an output constraint: commits from each row's frontier
        i, final = 0, steps - 1
        while i <= final:
            mask_index = x == mask_id
            live = last >= i
            k = torch.where(live, torch.minimum(quota + left, mask_index.sum(1)), 0)
            cand = mask_index if C is None else window(C, mask_index, k.tolist())
            conf, x0 = yield from evaluate(predict(x, 0, x.shape[1], cand, None, plain))
            c = commit_top_threshold(conf, k, gen.threshold, starts_of(predict))
            t = None if C is None else settle(C, c.settle(), run=True)   # the run of kept positions from the frontier
            dropped = k - (c.mask if t is None else t).sum(1)
            left = torch.where(dropped > 0, dropped, torch.where(live, 0, left))
            extend = (dropped > 0) & (last == i)     # the published loop adds a step, quota 0
            quota, last = torch.where(extend, 0, quota), torch.where(extend, last + 1, last)
            if C is None:
                got = apply(x, x0, c, lambda: torch.stack([last, mask_index.sum(1)]))
                final = max(got[0])
                yield StepDone(sum(got[1]))
            else:
                x[t] = x0[t]
                committed(C, x)
                final = int(last.max())
                yield StepDone(int(mask_index.sum()))
            i += 1
        return {"row_nfe": [lst + 1 for lst in last.tolist()]}   # alone, a row runs every step up to its last

    def planned_predict(self, gen, generator):
        """predict(x, a, b, sample [B, b-a], mode, how) -> (conf, x0) [B, b-a] (-inf / mask id
        where not sampled): slot at canvas row p reads the hidden row p-1 of the rows [a, b)
        that ran (the first of them reads itself), as the published shift inside a block step."""
        mask_id = self.mcfg.mask_id

        def predict(x, a, b, sample, mode, how):
            B, n = x.shape[0], b - a
            flat = sample.reshape(-1).nonzero().squeeze(1)                     # [M] of the B*n rows
            j = flat % n
            rows = torch.where(j > 0, flat - 1, flat)
            reducer = DreamReducer(how, generator, with_confidence=True)
            spec = None if mode is None else CacheStep(mode, a, b, x.shape[1])
            outs = yield RowsCall(x, rows, None, reducer, positions=flat + a, cache=spec)
            conf = torch.full((B * n,), -torch.inf, dtype=outs["conf"].dtype, device=x.device)
            conf[flat] = outs["conf"]
            x0 = torch.full((B * n,), mask_id, dtype=torch.long, device=x.device)
            x0[flat] = outs["x0"]
            return conf.view(B, n), x0.view(B, n)
        return predict

