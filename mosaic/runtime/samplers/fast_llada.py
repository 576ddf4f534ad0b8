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

import torch

from ...errors import InputError
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
        # the device one step ahead of the host (_block_ahead): where no random draw, output
        # constraint or tie-ranking reader would see the step launched ahead
        ahead = RUN_AHEAD and gen.cache != "none" and C is None and gen.temperature == 0 and \
            gen.remasking == "low_confidence" and inspect.isgeneratorfunction(getattr(predict, "fn", predict))
        discarded = 0

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
            a, b = (lo, L) if gen.cache == "prefix" else (lo, hi) if gen.cache == "dual" else (0, L)
            if ahead:
                rows_nfe.add_(cand.any(1).long())
                after = self._after(x, cand, lo, hi)
                first = (x, x0, commit(conf, counts[:, 0]), after)
                discarded += yield from self._block_ahead(predict, x, first, (lo, hi, a, b), bound, counts, how,
                                                          commit, rows_nfe)
                continue
            masks_left, event = step(x, x0, commit(conf, counts[:, 0]), cand, lo, hi)  # (counts: the schedule's)
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
        return {"row_nfe": rows_nfe.tolist()} | ({"forwards_discarded": discarded} if ahead else {})

    def _after(self, x, cand, lo, hi):
        """after() of a commit: [2, B] (the block's masks left per row, the step's candidates)."""
        mask_id = self.mcfg.mask_id
        return lambda: torch.stack([(x[:, lo:hi] == mask_id).sum(1), cand.sum(1)])

    def _block_ahead(self, predict, x, first, span, bound, counts, how, commit, rows_nfe):
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
        after); returns the forwards discarded."""
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
            yield StepDone(sum(masked))
            if ahead is None or not any(left):
                return discarded + (ahead is not None)
            if fixed:                 # a tie changed the canvas after step i was launched: run it again
                discarded += 1
                ahead = yield from self._launch(predict, x, a, b, hi)
            finish, held, cand = ahead
            P.restore_checks(held)
            x0, conf = finish()
            view, c = x[:, a:b], commit(conf, counts[:, i] if how == "counts" else None, a)
            rows_nfe.add_(cand.any(1).long())
            after = self._after(x, cand, lo, hi)
            pending = apply_async(view, x0, c, after)
            i += 1

    def _launch(self, predict, x, a, b, hi):
        """Yield block step [a, b)'s call (every block row predicted: its rows need no host read)
        and return (finish() -> (x0, conf), the NaN tests its execution left, its candidates)."""
        cand = x[:, a:b] == self.mcfg.mask_id
        cand[:, hi - a:] = False
        g = predict(x, a, b, cand, "block", block_rows=hi - a)
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
        """predict(x, a, b, cand [B, b-a], mode, extra_noise) -> (x0, conf) [B, b-a]: the
        candidates' tokens and confidences over canvas rows [a, b) (-inf elsewhere), from a
        plain step (mode None), a store fill or a block step."""
        mcfg = self.mcfg
        gen64 = dataclasses.replace(gen, confidence_dtype="float64", cache="none", threshold=None, factor=None)

        def predict(x, a, b, cand, mode, extra_noise=False, block_rows=None):
            B, n = x.shape[0], b - a
            if extra_noise and gen.temperature > 0 and x.device.type != "cuda":
                # the published prefix loop draws one Gumbel noise tensor it never uses
                NoiseStream(B * n, mcfg.vocab, generator, x.device).finish()
            if block_rows is None:
                rows = cand.reshape(-1).nonzero().squeeze(1)                   # [M] of the B*n rows
            else:   # the first block_rows of each row, candidates or not: no host read (_block_ahead)
                rows = (torch.arange(B, device=x.device)[:, None] * n +
                        torch.arange(block_rows, device=x.device)).reshape(-1)
            reducer = LLaDAReducer(mcfg, gen64, rows, B * n, generator, x.device)
            spec = None if mode is None else CacheStep(mode, a, b, x.shape[1])
            outs = yield RowsCall(x, rows, None, reducer, cache=spec)
            reducer.finish()
            x0, conf = scatter_prediction(x[:, a:b], rows, outs, gen.remasking, generator, torch.float64)
            if block_rows is not None:   # predictions outside the candidates are not the published call's
                x0 = torch.where(cand, x0, x[:, a:b])
                conf = conf.masked_fill(~cand, -torch.inf)
            return x0, conf
        return predict

