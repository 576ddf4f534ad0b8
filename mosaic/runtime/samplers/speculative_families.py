"""The self-speculative variants of LLaDA's and Dream's exact samplers (speculative.py: the
method). Each gives the family's schedule (tokens committed per step, as the published loop
computes them), the candidates' right bound of a step (LLaDA: its block; Dream: the canvas), the
batched verification call and the reference's decision on one row.

Where it applies: the greedy samplers, whose every decision is a function of the canvas's
forward alone (temperature 0; LLaDA low_confidence remasking without cfg; Dream's maskgit_plus,
topk_margin and entropy without alg_temp), on the planned path, one process, dense attention.
Everything else is refused up front with what would run instead."""

from __future__ import annotations

import torch

from ...errors import InputError
from .. import published as P
from ..reducers import DreamReducer, LLaDAReducer
from ..ties import topk, topk_batch
from .base import RowsCall
from .dream import DreamSampler
from .llada import LLaDASampler, scatter_prediction
from .speculative import lockstep_loop, speculative_loop

WHY = "self-speculative decoding (speculate > 0) verifies the greedy sampler's own decisions"


def rank(conf: torch.Tensor, k: int, start: int = 0) -> torch.Tensor:
    """[k] positions of the k highest confidences of one row conf [L]: torch.topk on the row's
    full-length vector, the call LLaDA's loop makes (published.topk_transfer; from `start`, a
    left-padded row's first real token, where the engine ranks ties from there: runtime/ties.py)."""
    return topk(conf, k, start)[1]


class SpeculativeMixin:
    """What both families' speculative samplers share: the refusals, the admitted canvases and
    the loop. A subclass also derives from its family's exact sampler."""
    speculative = True

    def check(self, gen, prompt_len: int) -> None:
        """Refuse what self-speculative decoding cannot reproduce before the usual checks."""
        if gen.accelerated:
            raise InputError(f"{WHY}; it does not combine with Fast-dLLM's cache / threshold / factor (lossy "
                             "parallel commits): use one or the other")
        if gen.temperature > 0:
            raise InputError(f"{WHY}: it needs temperature 0 (a sampled token cannot be verified by another "
                             f"forward); got temperature {gen.temperature}")
        super().check(gen, prompt_len)
        self.check_speculative(gen)

    def check_speculative(self, gen) -> None:
        """The family's own refusals."""

    def longest_chain(self, gen) -> int:
        """The most steps one draft chain can take (the whole schedule; LLaDA: one block's)."""
        return self.total_steps(gen)

    def canvases(self, gen) -> int:
        """Canvases per row of the largest step (admission): `speculate`, or fewer when a chain
        cannot be that long (a speculate above the schedule's steps drafts no more: the admission
        and the plan charge only what a chain can use; speculate=100000 planned 100,000 canvases)."""
        return max(1, min(gen.speculate, self.longest_chain(gen)))

    def native_predict(self, gen, generator, valid):
        raise InputError(f"{WHY} on the planned path; drop native=True (--native)")

    lockstep = False    # the tokens per step depend on the batch's canvas: rows advance together

    def loop(self, predict, x, prompt_len, gen, generator):
        run = lockstep_loop if self.lockstep else speculative_loop
        return run(self, x, prompt_len, gen, generator, getattr(predict, "row_starts", None))

    def decide(self, conf: torch.Tensor, k: int, start: int = 0) -> torch.Tensor:
        """The positions [k] the step-by-step sampler commits from one row's confidences [L]."""
        return rank(conf, k, start)


class SpeculativeLLaDASampler(SpeculativeMixin, LLaDASampler):
    """LLaDA's sampler (low_confidence remasking, temperature 0, no cfg) with self-speculative
    verification; any schedule of its blocks (steps per block)."""
    options = LLaDASampler.options | {"speculate"}

    def check_speculative(self, gen) -> None:
        if gen.remasking != "low_confidence":
            raise InputError(f"{WHY}: it needs remasking 'low_confidence' ('random' draws the positions); got "
                             f"{gen.remasking!r}")
        if gen.cfg_scale > 0:
            raise InputError(f"{WHY}; classifier-free guidance (cfg_scale > 0) is not verified yet: use "
                             "cfg_scale 0 or speculate 0")

    def longest_chain(self, gen) -> int:
        """A chain never passes a block boundary: at most one block's steps."""
        return self.blocks(gen)[1]

    def schedule(self, x, prompt_len, gen) -> list[list[int]]:
        """Tokens per step per row, as the published loop computes them at each block's start
        (every block position masked then)."""
        blocks, steps = self.blocks(gen)
        bl = gen.block_length or gen.max_new_tokens
        mask_id = self.mcfg.mask_id
        out = [[] for _ in range(x.shape[0])]
        for nb in range(blocks):
            lo, hi = prompt_len + nb * bl, prompt_len + (nb + 1) * bl
            counts = P.num_transfer_tokens(x[:, lo:hi] == mask_id, steps)   # [B, steps]
            for b, c in enumerate(counts.tolist()):
                out[b] += c
        return out

    def right_of(self, prompt_len, gen, L):
        """right(step): the end of the block the step belongs to (candidates are left of it)."""
        _, steps = self.blocks(gen)
        bl = gen.block_length or gen.max_new_tokens
        return lambda i: prompt_len + (i // steps + 1) * bl

    def verify(self, ids, rights, owners, gen, generator):
        """(x0, conf) [C, L] of canvases ids [C, L], each over its masked positions left of its
        rights[c], as the planned predict computes them (conf -inf elsewhere)."""
        C, L = ids.shape
        cols = torch.arange(L, device=ids.device)
        cand = (ids == self.mcfg.mask_id) & (cols[None, :] < rights[:, None])
        rows = cand.reshape(-1).nonzero().squeeze(1)                          # [M] flattened
        reducer = LLaDAReducer(self.mcfg, gen, rows, C * L, generator, ids.device)
        outs = yield RowsCall(ids, rows, None, reducer, canvas_rows=owners)
        reducer.finish()
        return scatter_prediction(ids, rows, outs, gen.remasking, generator)


class SpeculativeDreamSampler(SpeculativeMixin, DreamSampler):
    """Dream's sampler (maskgit_plus, topk_margin or entropy; temperature 0; top_p / top_k
    filters allowed: they are deterministic) with self-speculative verification."""
    options = DreamSampler.options | {"speculate"}

    def check_speculative(self, gen) -> None:
        if gen.alg == "origin":
            raise InputError(f"{WHY}: alg 'origin' draws which positions to commit; use maskgit_plus, "
                             "topk_margin or entropy")
        if gen.alg_temp:
            raise InputError(f"{WHY}: alg_temp > 0 draws the positions; leave it unset (or 0)")

    lockstep = True

    def decide_batch(self, conf: torch.Tensor, k: int, starts) -> torch.Tensor:
        """[B, k] positions the step-by-step loop commits from the batch's confidences [B, L]:
        its own call (ties.topk_batch: one torch.topk over the batch, or each padded row from its
        start in bfloat16 / float16)."""
        return topk_batch(conf, k, starts)

    def counter(self, x, gen):
        """(count(step, masked), steps): the published tokens of a step from the batch's masked
        count (its mean over the B rows, in float32, as the published loop computes it; a row that
        commits the mask token keeps that position masked, so the count is the canvas's own)."""
        steps, B = self.total_steps(gen), x.shape[0]
        timesteps = torch.linspace(1, gen.eps, steps + 1, device=x.device)

        def count(i: int, masked: int) -> int:
            num_mask_token = torch.tensor(masked, device=x.device) / B    # mask_index.sum() / B
            return P.dream_transfer_count(num_mask_token, timesteps[i], timesteps[i + 1], i == steps - 1)
        return count, steps

    def verify(self, ids, rights, owners, gen, generator):
        """(x0, conf) [C, L] of canvases ids [C, L] over every masked slot (slot j reads row j-1,
        as the planned predict does; conf -inf elsewhere, in the dtype the sampler ranks)."""
        C, L = ids.shape
        pos = (ids == self.mcfg.mask_id).reshape(-1).nonzero().squeeze(1)    # [M] flattened
        rows = torch.where(pos % L == 0, pos, pos - 1)
        reducer = DreamReducer(gen, generator, with_confidence=True)
        outs = yield RowsCall(ids, rows, None, reducer, positions=pos, canvas_rows=owners)
        conf = torch.full((C * L,), -torch.inf, dtype=outs["conf"].dtype, device=ids.device)
        conf[pos] = outs["conf"]
        x0 = torch.full((C * L,), self.mcfg.mask_id, dtype=torch.long, device=ids.device)
        x0[pos] = outs["x0"]               # the published x_: the mask id where nothing is predicted
        return x0.view(C, L), conf.view(C, L)
