"""Dream's sampler (diffusion_generate): origin, maskgit_plus, topk_margin, entropy.

The loop is the published one (DreamLM/Dream, generation_utils.py). `predict(x, mask_index,
chosen)` returns (confidence, x0) for the masked positions in row-major order (restricted to
`chosen` among them when given), computed from logits shifted right by one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...errors import InputError
from .. import published as P
from ..commit import apply, commit_counts
from ..reducers import DreamReducer
from ..ties import topk_batch
from .base import LogitsCall, RowsCall, Sampler, StepDone, evaluate, starts_of
from .constraint import committed, constraint_of, settle, window

ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")
DREAM_MOST_STEPS = 512      # DreamGenerationConfig's default steps (for its default 20 new tokens)


class DreamSampler(Sampler):
    family = "dream"
    display = "Dream"
    options = frozenset({"alg", "alg_temp", "top_p", "top_k", "eps"})
    rank_coupled_draws = True   # origin's and alg_temp's draws run over the whole batch's rows

    def probe_reducer(self, gen, total_rows: int, device):
        return DreamReducer(gen, None, with_confidence=gen.alg != "origin")

    def check_own(self, gen, prompt_len: int) -> None:
        if gen.alg not in ALGS:
            raise InputError(f"alg {gen.alg!r} is not one of {ALGS}")
        if gen.top_p is not None and not 0 < gen.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {gen.top_p}")
        if gen.top_k is not None and gen.top_k <= 0:
            raise InputError(f"top_k must be positive, got {gen.top_k}")
        if gen.alg_temp is not None and gen.alg_temp < 0:
            raise InputError(f"alg_temp must be >= 0 (0 or unset: the most confident positions are kept; > 0: "
                             f"positions are drawn by confidence at that temperature), got {gen.alg_temp}")
        if not 0 <= gen.eps < 1:
            raise InputError(f"eps (the last timestep of the schedule) must be in [0, 1), got {gen.eps}")

    steps_reason = "Dream's schedule has no natural end; the bound keeps the forwards finite"

    def most_steps(self, gen) -> int:
        """Dream's schedule (timesteps linspace(1, eps, steps + 1)) moves with every step: a step may
        commit no token (origin commits each masked position with probability 1 - s/t), so more
        steps than new tokens are a different schedule, not wasted forwards; the published default
        is 512 steps for 20 tokens (DreamGenerationConfig). The bound only keeps the cost finite:
        512, or 32 per new token where that is more."""
        return max(DREAM_MOST_STEPS, 32 * gen.max_new_tokens)

    def constrained_rows(self, gen, length: int) -> int:
        """The window: the schedule's largest count k over the steps, every row committing k."""
        steps, left = self.total_steps(gen), gen.max_new_tokens
        timesteps = torch.linspace(1, gen.eps, steps + 1)
        most = 1
        for i in range(steps):
            k = P.dream_transfer_count(torch.tensor(left / 1.0), timesteps[i], timesteps[i + 1], i == steps - 1)
            most, left = max(most, k), left - max(k, 0)
        return min(most, gen.max_new_tokens)

    def draws(self, gen) -> bool:
        return gen.temperature > 0 or gen.alg == "origin" or bool(gen.alg_temp)

    def loop(self, predict, x, prompt_len, gen, generator):
        steps = self.total_steps(gen)
        mask_id = self.mcfg.mask_id
        timesteps = torch.linspace(1, gen.eps, steps + 1, device=x.device)
        C = constraint_of(predict)       # an output constraint: commits from each row's frontier
        for i in range(steps):
            mask_index = x == mask_id
            t, s = timesteps[i], timesteps[i + 1]
            if gen.alg == "origin":
                p_transfer = 1 - s / t if i < steps - 1 else 1
                x0 = torch.zeros_like(x[mask_index], dtype=torch.long) + mask_id
                chosen = torch.rand(*x0.shape, device=x.device, generator=generator) < p_transfer
                _, x0[chosen] = yield from evaluate(predict(x, mask_index, chosen))
                x[mask_index] = x0.clone()
            elif C is not None:
                yield from self._constrained_step(predict, x, mask_index, t, s, i == steps - 1, gen, generator, C)
            else:
                confidence, x0 = yield from evaluate(predict(x, mask_index, None))
                num_mask_token = mask_index.sum() / mask_index.shape[0]
                full = torch.full_like(x, -torch.inf, dtype=confidence.dtype).masked_scatter_(mask_index, confidence)
                # x_: the published canvas of predictions, the mask id where nothing is predicted
                x_ = torch.full_like(x, mask_id).masked_scatter_(mask_index, x0)
                if not gen.alg_temp:    # the published batched torch.topk, on the device (runtime/commit.py)
                    k = P.dream_transfer_tensor(num_mask_token, t, s, i == steps - 1)
                    c = commit_counts(full, k, starts_of(predict), batched=True)
                    yield StepDone(sum(apply(x, x_, c, lambda: mask_index.sum(1)[None])[0]))
                    continue
                k = P.dream_transfer_count(num_mask_token, t, s, i == steps - 1)
                if k > 0:
                    transfer_index = draw_positions(full, gen.alg_temp, k, generator)
                    row = torch.arange(x.size(0), device=x.device).unsqueeze(1).expand_as(transfer_index)
                    x[row, transfer_index] = x_[row, transfer_index]
            yield StepDone(int(mask_index.sum()))
        return {}

    def _constrained_step(self, predict, x, mask_index, t, s, last, gen, generator, C):
        """One step under an output constraint (runtime/samplers/constraint.py): the same count k,
        predicted only on each row's next k free positions, committed from the frontier."""
        k = P.dream_transfer_count(mask_index.sum() / mask_index.shape[0], t, s, last)
        if k <= 0:
            return
        cand = window(C, mask_index, [k] * x.shape[0])
        confidence, x0 = yield from evaluate(predict(x, cand, None))
        full = torch.full_like(x, -torch.inf, dtype=confidence.dtype)
        full[cand] = confidence
        idx = topk_batch(full, k, starts_of(predict)) if not gen.alg_temp else \
            draw_positions(full, gen.alg_temp, k, generator)
        transfer = torch.zeros_like(cand)
        transfer[torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(idx), idx] = True
        x_ = torch.full_like(x, self.mcfg.mask_id)
        x_[cand] = x0
        transfer = settle(C, transfer & cand)
        x[transfer] = x_[transfer]
        committed(C, x)

    def one_step(self, predict, x):
        return (yield from evaluate(predict(x, x == self.mcfg.mask_id, None)))

    @staticmethod
    def _alg_kwargs(gen):
        return dict(temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
                    margin_confidence=gen.alg == "topk_margin", neg_entropy=gen.alg == "entropy")

    def native_predict(self, gen, generator, valid):
        def predict(x, mask_index, chosen):
            logits = yield LogitsCall(x, valid)
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
            mask_logits = logits[mask_index]
            if chosen is not None:
                mask_logits = mask_logits[chosen]
            return P.sample_tokens(mask_logits, generator=generator, **self._alg_kwargs(gen))
        return predict

    def planned_predict(self, gen, generator):
        """Masked slot j reads hidden row j-1 of its sequence (row 0 reads itself)."""
        def predict(x, mask_index, chosen):
            B, L = x.shape
            pos = mask_index.reshape(-1).nonzero().squeeze(1)                   # [M] flattened
            if chosen is not None:
                pos = pos[chosen]
            rows = torch.where(pos % L == 0, pos, pos - 1)
            reducer = DreamReducer(gen, generator, with_confidence=chosen is None)
            outs = yield RowsCall(x, rows, None, reducer, positions=pos)
            return outs.get("conf"), outs["x0"]
        return predict


def draw_positions(confidence: torch.Tensor, alg_temp: float, k: int, generator) -> torch.Tensor:
    """[B, k] positions per row drawn without replacement with weights softmax(confidence /
    alg_temp) (confidence [B, L], -inf where a position is not masked), as the reference does.

    Deviation (docs/MODELS.md): where a row has fewer than k positions of non-zero weight (the
    softmax underflows at a small alg_temp: 10 of 16 positions at 4 steps with 'entropy'), the
    reference asks torch.multinomial for the impossible: on the CPU it returns positions of zero
    weight (already decoded or prompt tokens, overwritten with the mask id), on CUDA it fails a
    device-side assert. Here such a row takes every position of non-zero weight by the draw and
    fills the shortfall with its most confident remaining masked positions, so each step still
    decodes k masked positions. Rows without a shortfall are drawn exactly as the reference."""
    weights = F.softmax(confidence / alg_temp, dim=-1)
    nonzero = (weights > 0).sum(dim=-1)
    if bool((nonzero >= k).all()):
        return torch.multinomial(weights, num_samples=k, generator=generator)
    rows = []
    for b in range(weights.shape[0]):
        n = min(k, int(nonzero[b]))
        drawn = torch.multinomial(weights[b], num_samples=n, generator=generator) if n else \
            torch.empty(0, dtype=torch.long, device=weights.device)
        rest = confidence[b].clone()
        rest[drawn] = -torch.inf
        rows.append(torch.cat([drawn, torch.topk(rest, k - n).indices]))
    return torch.stack(rows)
