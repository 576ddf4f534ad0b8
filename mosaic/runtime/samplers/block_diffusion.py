"""The block-diffusion sampler: LLaDA2.x's published generate() (LLaDA2.0, and LLaDA2.1 with token
editing) and the samplers of its kind (SDAR's block_diffusion_generate), over an exact block cache.

The loop is the published LLaDA2MoeModelLM.generate() (inclusionAI/dFactory
models/llada2_moe/modeling_llada2_moe.py, commit 49c315c; the hub's LLaDA2.0-mini copy; the
LLaDA2.1-mini copy for editing), per sequence; a family's record (models/families/) gives the
published variant's knobs (`sampler_params`, PARAMS below); docs/MODELS.md gives the semantics
and the deviations:

  blocks    of block_length columns from the prompt's first token; the one holding the prompt's
            tail is denoised first; causal across blocks (runtime/block_canvas.py)
  2.0       per block up to `steps` steps (steps per block, default block_length); step s may
            commit k_s = the s-th entry of block_length split over steps (the first
            block_length % steps one more): every masked position whose probability is >
            threshold when there are at least k_s of them, else the k_s most confident
            (torch.topk; clamp_fill: at most the masked count, else SDAR's topk, which may pick
            unmasked positions of the block and rewrite them)
  2.1       (editing_threshold set) until the block is filled: at least num_to_transfer masked
            positions per step (LLaDA2's rule with k = num_to_transfer), and every filled non-prompt position whose new
            prediction differs with probability > editing_threshold is rewritten
            (block_rules.edits); after the block is filled, up to max_post_steps more steps while
            edits happen
  tokens    temperature 0: argmax, its softmax probability; > 0: logits / temperature, top-k,
            top-p, one multinomial draw for every row of the block (block_rules: the published
            random stream)
  eos       with eos_early_stop (default), a sequence stops after the block in which its answer
            first holds an end-of-text id; without it every block runs (the published default);
            the tokens of the answer are the same either way

Each step runs the block's rows (and, at a block's first step, the rows finished since: their
K/V are computed once then, models/block_cache.py) and predicts only the rows the rule reads."""

from __future__ import annotations

import torch

from ...config import GENERATION_DEFAULTS
from ...errors import InputError
from ...models.families import family_of
from ..block_canvas import BlockCanvas
from ..commit import apply, commit_llada2
from .base import BlockCall, Sampler, StepDone
from .block_rules import BlockReducer, edits, stop_ids
from .constraint import committed, settle, window

# the published variant's knobs; a family record overrides them (Family.sampler_params).
# block_length, threshold: generate()'s defaults; cap_steps: steps = min(steps, gen_length);
# logits_fp32: probabilities from float32 logits; clamp_fill: the top-k fill takes at most the
# masked count; every_eos: stop at every end-of-text id of the checkpoint, not only eos_id;
# editing: LLaDA2.1's token editing exists for the family
PARAMS = {"block_length": 32, "threshold": 0.95, "cap_steps": True, "logits_fp32": True, "clamp_fill": True,
          "every_eos": False, "editing": True}
BASE_OPTIONS = frozenset({"block_length", "threshold", "top_p", "top_k", "eos_early_stop", "eos_id"})
EDIT_OPTIONS = frozenset({"editing_threshold", "max_post_steps", "num_to_transfer"})
MAX_EDIT_STEPS = 8    # x block length: an LLaDA2.1 block's steps before max_post_steps (published: no bound)


def transfer_schedule(block: int, steps: int) -> list[int]:
    """block positions split over steps, the first block % steps one more (as published)."""
    base, extra = divmod(block, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


class BlockDiffusionSampler(Sampler):
    family = "block_diffusion"
    display = "block-diffusion"
    options = BASE_OPTIONS | EDIT_OPTIONS
    block_diffusion = True   # the engine runs it as a BlockRun (engine/blocks.py) over a block canvas

    def __init__(self, mcfg):
        super().__init__(mcfg)
        fam = family_of(mcfg)
        self.params = {**PARAMS, **fam.sampler_params}
        self.display = f"{fam.display} (block diffusion)"
        self.options = BASE_OPTIONS | (EDIT_OPTIONS if self.params["editing"] else frozenset())

    def block(self, gen) -> int:
        return gen.block_length or self.params["block_length"]

    def steps_per_block(self, gen) -> int:
        """steps per block (the published meaning; LLaDA2 caps it at one per generated token)."""
        steps = gen.steps or self.block(gen)
        return min(steps, gen.max_new_tokens) if self.params["cap_steps"] else steps

    def threshold(self, gen) -> float:
        return self.params["threshold"] if gen.threshold is None else gen.threshold

    def editing(self, gen) -> bool:
        """LLaDA2.1's sampler (token editing), chosen by editing_threshold (the request's, its
        checkpoint's generation_config.json, or its published generate()'s default)."""
        return gen.editing_threshold is not None

    def check(self, gen, prompt_len: int) -> None:
        if not self.params["editing"]:     # a family of this kind without LLaDA2.1's editing (SDAR)
            stray = sorted(n for n in EDIT_OPTIONS if getattr(gen, n) != getattr(GENERATION_DEFAULTS, n))
            if stray:
                raise InputError(f"{', '.join(stray)}: LLaDA2.1's token-editing options; the published "
                                 f"{self.display} sampler has no token editing")
        super().check(gen, prompt_len)

    def check_own(self, gen, prompt_len: int) -> None:
        if gen.top_p is not None and not 0 < gen.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {gen.top_p}")
        if gen.eos_id is not None and gen.eos_id >= self.mcfg.vocab:
            raise InputError(f"eos_id {gen.eos_id} is outside this model's vocabulary [0, {self.mcfg.vocab})")
        if gen.eos_id is None and self.mcfg.eos_id is None:
            raise InputError("the block-diffusion sampler stops at the end-of-text token, and this model's "
                             "config.json has none (eos_token_id): add it, or pass eos_id")
        if gen.editing_threshold is not None and gen.editing_threshold > 1:
            raise InputError(f"editing_threshold must be in [0, 1] (a probability; LLaDA2.1's quality mode uses "
                             f"0.5, its speed mode 0.0), got {gen.editing_threshold}")
        stray = [n for n in ("max_post_steps", "num_to_transfer") if getattr(gen, n) != getattr(GENERATION_DEFAULTS, n)]
        if stray and not self.editing(gen):
            raise InputError(f"{' and '.join(stray)} belong to LLaDA2.1's token-editing sampler; set editing_threshold "
                             "(LLaDA2.1 uses 0.5 in quality mode, 0.0 in speed mode) or leave them unset")

    def total_steps(self, gen) -> int:
        blocks = -(-(gen.max_new_tokens + self.block(gen) - 1) // self.block(gen))
        per = MAX_EDIT_STEPS * self.block(gen) + gen.max_post_steps if self.editing(gen) else self.steps_per_block(gen)
        return per * blocks

    def max_steps(self, gen) -> int:
        return self.total_steps(gen)

    def first_masked(self, gen) -> int:
        return self.block(gen)

    def positions(self, gen, prompt_len: int) -> int:
        """Prompt + new tokens rounded up to whole blocks: the published generate() denoises
        the last block whole (a 10-token prompt with 500 new tokens in blocks of 100 runs 600
        positions)."""
        bl = self.block(gen)
        return -(-(prompt_len + gen.max_new_tokens) // bl) * bl

    def uses_cache(self, gen) -> bool:
        return True              # the block K/V store, for the whole request

    def native_predict(self, gen, generator, valid):
        raise InputError("the block-diffusion sampler runs on the planned path only (its block K/V cache is "
                         "exact by construction); drop native=True (--native)")

    def planned_predict(self, gen, generator):
        raise InputError("the block-diffusion sampler runs over a block canvas (loop_blocks), not a plain one")

    def one_step(self, predict, x):
        raise InputError("one_step measures a full-canvas step; block diffusion steps one block: use "
                         "python -m bench families")

    def block_reducer(self, gen, generator=None) -> BlockReducer:
        """The step's reducer (its draws from `generator`; None: the device's default)."""
        return BlockReducer(gen, generator, self.params["logits_fp32"])

    def loop_blocks(self, canvas: BlockCanvas, gen, generator, constraint=None):
        """Denoise canvas.ids in place, as a coroutine (samplers/base.py): each step yields a
        BlockCall (canvas columns [a, hi), rows [M] int64 flat over the B x (hi - a) rows that
        run, reducer) and receives {"x0": [M], "conf": [M]}, then yields StepDone. constraint:
        the request's output constraint (samplers/constraint.py: its calls reduce through it,
        commits run from each frontier; LLaDA2.0's loop only). Returns statistics."""
        run = _BlockRun(self, canvas, gen, generator, constraint)
        step = run.edit_block if self.editing(gen) else run.plain_block
        for k in range(min(run.first), canvas.num_blocks):
            live = torch.tensor([run.first[b] <= k and not run.done[b] for b in range(canvas.batch)],
                                device=canvas.ids.device)
            if not bool(live.any()):
                break
            yield from step(k, live)
            run.finish_block(k, live)
        return run.stats()


class _BlockRun:
    """One request's loop state: the canvas, which sequences are done, the stored columns."""

    def __init__(self, sampler: BlockDiffusionSampler, canvas: BlockCanvas, gen, generator, constraint=None):
        self.s, self.c, self.gen, self.generator = sampler, canvas, gen, generator
        self.C = constraint
        B, dev = canvas.batch, canvas.ids.device
        self.first = [canvas.first_block(b) for b in range(B)]
        self.done = [False] * B
        self.stored, self.nfe, self.edits = 0, 0, 0   # columns [0, stored) hold final K/V
        self.answer_lo = torch.tensor([canvas.answer(b)[0] for b in range(B)], device=dev)
        self.stop = stop_ids(gen, sampler.mcfg, sampler.params["every_eos"]).to(dev)

    def predict(self, k: int, cand: torch.Tensor):
        """Yield the step over block k predicting the candidates cand [B, block] (at temperature
        > 0 every row of the block: the published draw covers them all, block_rules); returns
        (x0, conf) [B, block] (mask id / -inf where not predicted)."""
        c, bl = self.c, self.c.block
        lo, hi, a = k * bl, (k + 1) * bl, self.stored
        n = hi - a
        full = torch.zeros(c.batch, n, dtype=torch.bool, device=c.ids.device)
        full[:, lo - a:] = True if self.gen.temperature > 0 and self.C is None else cand
        rows = full.reshape(-1).nonzero().squeeze(1)
        call = BlockCall(a, hi, rows, self.s.block_reducer(self.gen, self.generator))
        outs = (yield call) if self.C is None else (yield from self.C.run(call))   # a constraint walks its outputs
        self.stored, self.nfe = lo, self.nfe + 1      # [a, lo) are final now
        x0 = torch.full((c.batch * n,), self.s.mcfg.mask_id, dtype=torch.long, device=c.ids.device)
        conf = torch.full((c.batch * n,), -torch.inf, dtype=torch.float32, device=c.ids.device)
        x0[rows], conf[rows] = outs["x0"], outs["conf"]
        return x0.view(c.batch, n)[:, lo - a:], conf.view(c.batch, n)[:, lo - a:]

    def plain_block(self, k: int, live: torch.Tensor):
        """LLaDA2.0's (and SDAR's) steps over block k for the live sequences; the published rule
        for every row at once (runtime/commit.py), one readback per step."""
        x, bl, mask_id = self.c.ids, self.c.block, self.s.mcfg.mask_id
        lo, hi = k * bl, (k + 1) * bl
        steps, thr, clamp = self.s.steps_per_block(self.gen), self.s.threshold(self.gen), self.s.params["clamp_fill"]
        schedule = transfer_schedule(bl, steps)
        left = lambda: ((x[:, lo:hi] == mask_id) & live[:, None]).sum(1)  # noqa: E731
        remaining = int(left().sum())
        for s in range(steps):
            if remaining == 0:
                break
            active = window(self.C, (x[:, lo:hi] == mask_id) & live[:, None], [bl] * self.c.batch, lo)   # [B, bl]
            if self.C is not None and not bool(active.any()):   # the constrained span of this block is done
                break
            # SDAR's unclamped top-k may rewrite unmasked positions: then every block row is predicted
            over = not clamp and self.C is None and bool(((active.sum(1) < schedule[s]) & active.any(1)).any())
            x0, conf = yield from self.predict(k, active.any(1, keepdim=True) if over else active)
            c = commit_llada2(conf, schedule[s], thr, allowed=active, clamp=clamp)
            if self.C is None:
                masked, left_now = apply(x[:, lo:hi], x0, c, lambda: torch.stack([active.sum(1), left()]))
                remaining = sum(left_now)
                yield StepDone(sum(masked))
                continue
            chosen = settle(self.C, c.settle(), a=lo)      # an output constraint: from each row's frontier
            x[:, lo:hi][chosen] = x0[chosen]
            committed(self.C, x)
            remaining = int(left().sum())
            yield StepDone(int(active.sum()))

    def edit_block(self, k: int, live: torch.Tensor):
        """LLaDA2.1's steps over block k: fill and edit until filled and no edit, or max_post_steps
        steps after filled. Mosaic's departure (docs/MODELS.md): a sequence whose step at
        temperature 0 changed no token stops the block there (the published loop would repeat that
        step forever: a model that predicts the mask token itself), and a block ends after
        8 x block + max_post_steps steps (MAX_EDIT_STEPS) at any temperature."""
        x, bl, g = self.c.ids, self.c.block, self.gen
        lo, hi = k * bl, (k + 1) * bl
        cols = torch.arange(lo, hi, device=x.device)
        editable_col = cols[None, :] >= self.answer_lo[:, None]         # not the prompt's
        post = torch.zeros(self.c.batch, dtype=torch.long, device=x.device)
        running = live.clone()
        thr = self.s.threshold(g)
        for _ in range(MAX_EDIT_STEPS * bl + g.max_post_steps):
            old = x[:, lo:hi].clone()
            active = old == self.s.mcfg.mask_id
            filled = ~active.any(1)
            post += (filled & running).long()
            running &= post <= g.max_post_steps
            if not bool(running.any()):
                break
            active &= running[:, None]
            x0, conf = yield from self.predict(k, running[:, None] & editable_col)
            edit = edits(x0, conf, old, ~active & editable_col & running[:, None], g.editing_threshold)
            fill = commit_llada2(conf, g.num_to_transfer, thr, allowed=active).settle()   # runtime/commit.py
            take = fill | edit
            x[:, lo:hi] = torch.where(take, x0, old)
            running &= ~(filled & ~edit.any(1))
            if g.temperature == 0:                                          # a fixed point
                running &= (take & (x0 != old)).any(1)
            n_active, n_edit = torch.stack([active.sum(), edit.sum()]).tolist()
            self.edits += n_edit
            yield StepDone(n_active)

    def finish_block(self, k: int, live: torch.Tensor) -> None:
        """After block k: a sequence whose answer now holds a stop id is done (eos_early_stop)."""
        if not self.gen.eos_early_stop:
            return
        hi = (k + 1) * self.c.block
        cols = torch.arange(self.c.width, device=self.c.ids.device)
        span = (cols[None, :] >= self.answer_lo[:, None]) & (cols[None, :] < hi)
        hit = (torch.isin(self.c.ids, self.stop) & span).any(1) & live
        for b in hit.nonzero().flatten().tolist():
            self.done[b] = True

    def stats(self) -> dict:
        g = self.gen
        out = {"nfe": self.nfe, "blocks": self.c.num_blocks, "threshold": self.s.threshold(g)}
        if self.s.editing(g):
            return out | {"editing_threshold": g.editing_threshold, "max_post_steps": g.max_post_steps,
                          "num_to_transfer": g.num_to_transfer, "edits": self.edits}
        return out | {"steps_per_block": self.s.steps_per_block(g)}
