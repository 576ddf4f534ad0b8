"""LLaDA2.x's sampler: block diffusion with a confidence threshold, over an exact block cache.

The loop is the published LLaDA2MoeModelLM.generate() (inclusionAI/dFactory
models/llada2_moe/modeling_llada2_moe.py, commit 49c315c; the hub's LLaDA2.0-mini copy), per
sequence; docs/MODELS.md gives the semantics and the deviations:

  blocks    of block_length columns from the prompt's first token; the one holding the prompt's
            tail is denoised first; causal across blocks (runtime/block_canvas.py)
  per block up to `steps` steps (steps per block: the published meaning, default block_length);
            step s may commit k_s = the s-th entry of block_length split over steps (the first
            block_length % steps one more), counted from the block length, not its masks
  commit    every masked position whose probability is > threshold (default 0.95) when there
            are at least k_s of them, else the k_s most confident (torch.topk, as published)
  tokens    temperature 0: argmax, its float32 softmax probability; > 0: logits / temperature,
            top-k, top-p, one torch.multinomial draw per position
  eos       a sequence stops after the block in which its answer first holds eos_id; its answer
            is cut after that first eos (the published early stop inside a block changes no token)

Each step runs the block's rows (and, at a block's first step, the rows finished since: their
K/V are computed once then, models/block_cache.py) and predicts only its masked positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...errors import InputError
from ..block_canvas import BlockCanvas
from ..commit import apply, commit_llada2
from .base import BlockCall, Sampler, StepDone
from .constraint import committed, settle, window

DEFAULT_BLOCK = 32        # generate(block_length=32)
DEFAULT_THRESHOLD = 0.95  # generate(threshold=0.95)


def transfer_schedule(block: int, steps: int) -> list[int]:
    """block positions split over steps, the first block % steps one more (as published)."""
    base, extra = divmod(block, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


class BlockReducer:
    """Per masked row: x0 and its probability, as _sample_with_temperature_topk_topp computes
    them from the float32 logits (the published forward returns logits.float())."""

    def __init__(self, gen, generator):
        self.g, self.gen = gen, generator

    def subset(self, idx):
        return self

    def outputs(self, dtype):
        return [("x0", torch.int64), ("conf", torch.float32)]

    fused = None

    def signature(self):
        return ("llada2", self.g.temperature > 0, self.g.top_k, self.g.top_p)

    def transient_bytes(self, m, V, dtype) -> int:
        # the float32 logits and their softmax; sampling adds filtered copies, the top-p sort's
        # values and int64 ids, its cumulative sum and masks
        return m * V * 4 * 2 + (m * V * (4 * 4 + 8 + 2) if self.g.temperature > 0 else 0)

    def __call__(self, lg, lu, a, b, outs):
        g = self.g
        logits = lg.float()
        if g.temperature == 0:
            x0 = logits.argmax(dim=-1, keepdim=True)
            probs = F.softmax(logits, dim=-1)
        else:
            logits = logits / g.temperature
            if g.top_k is not None and g.top_k > 0:
                kth = torch.topk(logits, min(g.top_k, logits.shape[-1]))[0][..., -1, None]
                logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
            if g.top_p is not None and g.top_p < 1.0:
                srt, order = torch.sort(logits, descending=True)
                cum = torch.cumsum(F.softmax(srt, dim=-1), dim=-1)
                drop = cum > g.top_p
                drop[..., 1:] = drop[..., :-1].clone()
                drop[..., 0] = False
                gone = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, drop)
                logits = logits.masked_fill(gone, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            x0 = torch.multinomial(probs, num_samples=1, generator=self.gen)
        outs["x0"].copy_(x0[:, 0])
        outs["conf"].copy_(torch.gather(probs, -1, x0)[:, 0])

    def finish(self):
        pass


class BlockDiffusionSampler(Sampler):
    family = "llada2"
    display = "LLaDA2 (block diffusion)"
    options = frozenset({"block_length", "threshold", "top_p", "top_k"})
    block_diffusion = True   # the engine runs it as a BlockRun (engine/blocks.py) over a block canvas

    def block(self, gen) -> int:
        return gen.block_length or DEFAULT_BLOCK

    def steps_per_block(self, gen) -> int:
        """steps per block (the published meaning), at most one per generated token."""
        return min(gen.steps or self.block(gen), gen.max_new_tokens)

    def threshold(self, gen) -> float:
        return DEFAULT_THRESHOLD if gen.threshold is None else gen.threshold

    def check_own(self, gen, prompt_len: int) -> None:
        if gen.top_p is not None and not 0 < gen.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {gen.top_p}")
        if self.mcfg.eos_id is None:
            raise InputError("the block-diffusion sampler stops at the end-of-text token, and this model's "
                             "config.json has none (eos_token_id): add it")

    def total_steps(self, gen) -> int:
        return self.steps_per_block(gen) * -(-(gen.max_new_tokens + self.block(gen) - 1) // self.block(gen))

    def max_steps(self, gen) -> int:
        return self.total_steps(gen)

    def first_masked(self, gen) -> int:
        return self.block(gen)

    def uses_cache(self, gen) -> bool:
        return True              # the block K/V store, for the whole request

    def native_predict(self, gen, generator, valid):
        raise InputError("the block-diffusion sampler runs on the planned path only (its block K/V cache is "
                         "exact by construction); drop native=True (--native)")

    def planned_predict(self, gen, generator):
        raise InputError("the block-diffusion sampler runs over a block canvas (loop_blocks), not a plain one")

    def one_step(self, predict, x):
        raise InputError("one_step measures a full-canvas step; block diffusion steps one block: use "
                         "bench/bench_families.py")

    def lossy_labels(self, gen, device, native):
        if gen.temperature > 0:
            return ["multinomial-stream: draws only for masked positions of the block, so the random stream "
                    "differs from the published generate's (same distribution)"]
        return []

    def loop_blocks(self, canvas: BlockCanvas, gen, generator, constraint=None):
        """Denoise canvas.ids in place, as a coroutine (samplers/base.py): each step yields a
        BlockCall (canvas columns [a, hi), rows [M] int64 flat over the B x (hi - a) rows that
        run, reducer) and receives {"x0": [M], "conf": [M]}, then yields StepDone. Returns
        statistics (steps, blocks). constraint: the request's output constraint
        (samplers/constraint.py: its calls reduce through it, commits run from each frontier)."""
        C = constraint
        x, bl = canvas.ids, canvas.block
        B, mask_id, eos = canvas.batch, self.mcfg.mask_id, self.mcfg.eos_id
        steps, thr = self.steps_per_block(gen), self.threshold(gen)
        schedule = transfer_schedule(bl, steps)
        first = [canvas.first_block(b) for b in range(B)]
        first_t = torch.tensor(first, device=x.device)
        answer_lo = torch.tensor([canvas.answer(b)[0] for b in range(B)], device=x.device)
        cols = torch.arange(x.shape[1], device=x.device)
        done = torch.zeros(B, dtype=torch.bool, device=x.device)
        stored = 0                                   # columns [0, stored) hold final K/V
        nfe = 0
        for k in range(min(first), canvas.num_blocks):
            lo, hi = k * bl, (k + 1) * bl
            live = (first_t <= k) & ~done
            left = lambda: ((x[:, lo:hi] == mask_id) & live[:, None]).sum(1)  # noqa: E731
            got = torch.stack([live.long(), left()]).tolist()                   # one read per block
            if not any(got[0]):
                break
            remaining = sum(got[1])
            for s in range(steps):
                if remaining == 0:
                    break
                active = window(C, (x[:, lo:hi] == mask_id) & live[:, None], [bl] * B, lo)   # [B, bl]
                if C is not None and not bool(active.any()):   # the constrained span of this block is done
                    break
                a = stored
                n = hi - a
                cand = torch.zeros(B, n, dtype=torch.bool, device=x.device)
                cand[:, lo - a:] = active
                rows = cand.reshape(-1).nonzero().squeeze(1)
                reducer = BlockReducer(gen, generator)
                call = BlockCall(a, hi, rows, reducer)
                outs = (yield call) if C is None else (yield from C.run(call))   # a constraint walks its outputs
                stored = lo                                                # [a, lo) are final now
                nfe += 1
                x0 = torch.full((B * n,), mask_id, dtype=torch.long, device=x.device)
                conf = torch.full((B * n,), -torch.inf, dtype=torch.float32, device=x.device)
                x0[rows], conf[rows] = outs["x0"], outs["conf"]
                x0, conf = x0.view(B, n)[:, lo - a:], conf.view(B, n)[:, lo - a:]
                # the published rule for every row at once (runtime/commit.py); one readback
                c = commit_llada2(conf, schedule[s], thr, allowed=active)
                if C is None:
                    masked, left_now = apply(x[:, lo:hi], x0, c, lambda: torch.stack([active.sum(1), left()]))
                    remaining = sum(left_now)
                    yield StepDone(sum(masked))
                    continue
                chosen = settle(C, c.settle(), a=lo)      # an output constraint: from each row's frontier
                x[:, lo:hi][chosen] = x0[chosen]
                committed(C, x)
                remaining = int(left().sum())
                yield StepDone(int(active.sum()))
            # a sequence stops after the block in which its answer first holds eos
            done = done | (live & ((x == eos) & (cols >= answer_lo[:, None]) & (cols < hi)).any(1))
        return {"nfe": nfe, "blocks": canvas.num_blocks, "steps_per_block": steps, "threshold": thr}
