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
import inspect
from functools import lru_cache

import torch

from ...errors import InputError
from ...kernels.host_ints import ints_on
from ...models.kv_cache import CacheStep
from .. import published as P
from ..commit import apply, apply_async, commit_counts, commit_factor, commit_threshold, settle_read
from ..reducers import LLaDAReducer, NoiseStream
from ..ties import within
from .base import RowsCall, StepDone, evaluate, starts_of
from .constraint import WINDOW, committed, constraint_of, settle, window
from .fast_common import FastSamplerMixin, check_fast, rule
from .llada import LLaDASampler, scatter_prediction

FAST_OPTIONS = frozenset({"cache", "threshold", "factor"})
# a cached block's next step launched before the host reads the last one (_block_ahead); False:
# every step waits for its readback before the next is launched (the oracle; tests set it)
RUN_AHEAD = True


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
        nfe = [0] * x.shape[0]        # run ahead: rows_nfe counted on the host from each step's readback
        # the device one step ahead of the host (_block_ahead): where no random draw, output
        # constraint or tie-ranking reader would see the step launched ahead
        ahead = RUN_AHEAD and gen.cache != "none" and C is None and gen.temperature == 0 and \
            gen.remasking == "low_confidence" and inspect.isgeneratorfunction(getattr(predict, "fn", predict))
        discarded = 0
        # every candidate of the next fill lies in its block (no mask id in the prompt, every block
        # so far completed): the fill predicts the block's rows, with no read of the candidates
        # (a nonzero, which waits for the device). Read once here, at the request's start.
        clean = ahead and not bool((x[:, :prompt_len] == mask_id).any())

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
            # the schedule (counts only: the other rules never read it)
            counts = P.num_transfer_tokens(x[:, lo:hi] == mask_id, spb) if how == "counts" else None  # [B, spb]
            k0 = counts[:, 0] if counts is not None else None
            cand = x == mask_id
            cand[:, hi:] = False
            stop = gen.threshold if how == "threshold" else None     # a walk may stop below it (constraint.py)
            cand = window(C, cand, k0, stop=stop)
            a, b = (lo, L) if gen.cache == "prefix" else (lo, hi) if gen.cache == "dual" else (0, L)
            if ahead:
                x0, conf = yield from predict(x, 0, L, cand, "fill", span=(lo, hi) if clean else None)
                after = self._after(x, cand, lo, hi, lo if clean else None)
                first = (x, x0, commit(conf, k0), after)
                gone, left = yield from self._block_ahead(predict, x, first, (lo, hi, a, b), bound, counts, how,
                                                          commit, nfe)
                discarded += gone
                clean = clean and not any(left)
                continue
            x0, conf = yield from evaluate(predict(x, 0, L, cand, "fill" if gen.cache != "none" else None))
            masks_left, event = step(x, x0, commit(conf, k0), cand, lo, hi)  # (counts: the schedule's)
            yield event
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
        # run ahead: every step counted on the host (no read at the end, while others' steps run)
        row_nfe = nfe if ahead else rows_nfe.tolist()
        return {"row_nfe": row_nfe} | ({"forwards_discarded": discarded} if ahead else {})

    def _after(self, x, cand, lo, hi, c0=None):
        """after() of a commit: [2, B] (the block's masks left per row, the step's candidates).
        c0: the column of cand [B, *] that is the block's first, where every candidate lies
        (both counts in one stacked reduction), or None (the candidates summed on their own)."""
        mask_id = self.mcfg.mask_id
        if c0 is None:
            return lambda: torch.stack([(x[:, lo:hi] == mask_id).sum(1), cand.sum(1)])
        part = cand[:, c0:c0 + hi - lo]
        return lambda: torch.stack([x[:, lo:hi] == mask_id, part]).sum(2)

    def _block_ahead(self, predict, x, first, span, bound, counts, how, commit, nfe):
        """A cached block's steps with the device run one step ahead of the host (RUN_AHEAD):
        step i+1 is launched (its canvas, candidates and rows computed on the device from step
        i's commit) before step i's readback is read, so the host's sampler and scheduler round
        overlap the device's next step. Step i's readback then decides, as the published loop
        does, whether step i+1 runs: if step i completed the block (or a tie, committed by the
        published call after the readback, changed the canvas) the step launched ahead is
        discarded unread, its NaN test dropped; a tie reruns it on the settled canvas. So the
        tokens and the forwards counted (StepDone, row_nfe) are the plain loop's; the forwards
        launched and discarded are returned (stats `forwards_discarded`). A discarded step wrote
        only the block's rows of the store (dual: [lo, hi); prefix: [lo, L)), which the next
        block's fill rewrites (or a rerun, for a tie). first: the fill's (view, x0, commit,
        after); nfe: per row the forwards it would have run alone, counted here from each
        readback's candidates (no device op). Returns (the forwards discarded, the block's
        masks left per row at its end)."""
        lo, hi, a, b = span
        view, x0, c, after = first
        pending = apply_async(view, x0, c, after)
        discarded, i = 0, 1
        while True:
            ahead = None
            if i < bound:             # launch step i before reading step i-1
                ahead = yield from self._launch(predict, x, a, b, hi)
            got = pending.read()                         # waits for step i-1 only
            (left, masked), fixed = settle_read(view, x0, c, got, after)
            for j, m in enumerate(masked):      # a row alone would have run this step
                nfe[j] += m > 0
            yield StepDone(sum(masked))
            if ahead is None or not any(left):
                return discarded + (ahead is not None), left
            if fixed:                 # a tie changed the canvas after step i was launched: run it again
                discarded += 1
                ahead = yield from self._launch(predict, x, a, b, hi)
            finish, held, cand = ahead
            P.restore_checks(held)
            x0, conf = finish()
            view, c = x[:, a:b], commit(conf, counts[:, i] if how == "counts" else None, a)
            after = self._after(x, cand, lo, hi, 0)
            pending = apply_async(view, x0, c, after)
            i += 1

    def _launch(self, predict, x, a, b, hi):
        """Yield block step [a, b)'s call (every block row predicted: its rows need no host read)
        and return (finish() -> (x0, conf), the NaN tests its execution left, its candidates)."""
        cand = x[:, a:b] == self.mcfg.mask_id
        if hi < b:            # prefix: rows past the block are never candidates
            cand[:, hi - a:] = False
        g = predict(x, a, b, cand, "block", span=(0, hi - a))
        outs = yield next(g)
        held = P.take_checks()       # read with this step's own readback, not step i-1's

        def finish():
            try:
                g.send(outs)
            except StopIteration as stop:
                return stop.value
            raise RuntimeError("a block step's predict yielded twice")
        return finish, held, cand

    def planned_predict(self, gen, generator):
        """predict(x, a, b, cand [B, b-a], mode, extra_noise, span) -> (x0, conf) [B, b-a]: the
        candidates' tokens and confidences over canvas rows [a, b) (-inf elsewhere), from a
        plain step (mode None), a store fill or a block step. span (s, e): predict columns
        [s, e) of every row, candidates or not, where the caller knows every candidate lies
        there: no host read of the candidates (run ahead: _block_ahead, and its fills)."""
        mcfg = self.mcfg
        gen64 = dataclasses.replace(gen, confidence_dtype="float64", cache="none", threshold=None, factor=None)

        def predict(x, a, b, cand, mode, extra_noise=False, span=None):
            B, n = x.shape[0], b - a
            if extra_noise and gen.temperature > 0 and x.device.type != "cuda":
                # the published prefix loop draws one Gumbel noise tensor it never uses
                NoiseStream(B * n, mcfg.vocab, generator, x.device).finish()
            # [M] of the B*n rows: the candidates, or the span's (cached: no host read, no kernel)
            rows = cand.reshape(-1).nonzero().squeeze(1) if span is None else span_rows(B, n, *span, x.device)
            reducer = LLaDAReducer(mcfg, gen64, rows, B * n, generator, x.device)
            spec = None if mode is None else CacheStep(mode, a, b, x.shape[1])
            outs = yield RowsCall(x, rows, None, reducer, cache=spec)
            reducer.finish()
            if span is None:
                return scatter_prediction(x[:, a:b], rows, outs, gen.remasking, generator, torch.float64)
            return span_prediction(x[:, a:b], cand, outs, span)
        return predict


@lru_cache(maxsize=64)
def span_rows(B: int, n: int, s: int, e: int, device: torch.device) -> torch.Tensor:
    """[B * (e - s)] int64: columns [s, e) of every row of a [B, n] canvas slice, flat, ascending
    (the order nonzero() gives the candidates). Read-only: every step of a block shares it."""
    return ints_on([r * n + j for r in range(B) for j in range(s, e)], device)


def span_prediction(x: torch.Tensor, cand: torch.Tensor, outs: dict, span) -> tuple[torch.Tensor, torch.Tensor]:
    """(x0, conf) [B, n] over the canvas slice x [B, n] from a step that predicted columns
    [s, e) of every row (outs "x0", "conf" [B * (e - s)]): the prediction at the candidates,
    x and -inf elsewhere, as scatter_prediction of the candidates' rows gives them (every
    candidate lies in [s, e): the caller's knowledge). Views where the span is the whole slice."""
    B, n = x.shape
    s, e = span
    got, conf = outs["x0"].view(B, e - s), outs["conf"].view(B, e - s).to(torch.float64)
    if (s, e) == (0, n):
        return torch.where(cand, got, x), torch.where(cand, conf, -torch.inf)
    c = cand[:, s:e]
    x0 = x.clone()
    x0[:, s:e] = torch.where(c, got, x[:, s:e])
    full = torch.full((B, n), -torch.inf, dtype=torch.float64, device=x.device)
    full[:, s:e] = torch.where(c, conf, -torch.inf)
    return x0, full
