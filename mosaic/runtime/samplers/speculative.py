"""Self-speculative decoding of an exact, greedy sampler: the step-by-step sampler's tokens with
fewer forwards.

Method (after SSD, Gao et al. 2025, arXiv 2510.04147: the model drafts from one forward and
verifies the drafts in one batched forward; MODELS.md says where this departs). A row's state is
the reference's canvas after s steps together with the prediction of that canvas's forward.

  draft   from that one prediction, the next commits in the order the step-by-step sampler
          would make them if the prediction did not change: step s's own decision (exact: it is
          the reference's), then the next most confident candidates, as many per step as the
          schedule commits, up to `speculate` steps, never past the current block
  verify  one RowsCall over the canvases those commits produce (after 1, 2, ..., n of them), all
          rows' chains stacked: ids [C, L], each canvas predicted with the candidates of the
          step that follows it
  accept  the longest prefix whose every next draft equals the decision the sampler takes on
          the previous canvas's own prediction (positions and tokens); the last accepted canvas
          and its prediction are the row's new state, so the next draft needs no new forward

Steps that commit nothing (Dream's first step at steps == max_new_tokens, LLaDA's steps past a
block's tokens) leave the canvas as it is, so they take no forward here. Each row accepts on its
own; rows that are done leave the verification batch. The loop commits to the request's canvas
x one reference step at a time, once every row has decided it, and yields a StepDone per step:
after the s-th StepDone, x is the step-by-step sampler's canvas after s steps.

A family (speculative_families.py) gives: schedule (tokens per step per row), right (the
candidates' right bound of a step), verify (the batched call) and decide (the reference's
choice of positions from one row's confidences). A family whose tokens per step depend on the
whole batch's canvas (Dream: the batch's mean masked count) runs `lockstep_loop` instead: every
row drafts the same steps and the batch accepts the prefix that every row verifies."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from .base import StepDone

EMPTY = None   # a step that commits nothing


@dataclass
class RowState:
    """One row's place in the reference's loop: canvas [L] after the steps before `step` (the
    next step that commits; T when the row is done) and (x0 [L], conf [L]) of its forward."""
    canvas: torch.Tensor
    step: int
    pred: tuple[torch.Tensor, torch.Tensor] | None = None


def next_step(counts: list[int], i: int) -> int:
    """The first step >= i that commits tokens (len(counts) when none is left)."""
    while i < len(counts) and counts[i] == 0:
        i += 1
    return i


def same_positions(pos_a: torch.Tensor, tok_a: torch.Tensor, pos_b: torch.Tensor, tok_b: torch.Tensor) -> bool:
    """Whether two commits (positions [k] with their tokens [k]) write the same canvas."""
    if pos_a.numel() != pos_b.numel():
        return False
    oa, ob = pos_a.argsort(), pos_b.argsort()
    return bool(torch.equal(pos_a[oa], pos_b[ob]) and torch.equal(tok_a[oa], tok_b[ob]))


def draft(row: RowState, counts: list[int], right, decide, speculate: int, start: int):
    """The chain of one row: [(step, positions [k], tokens [k])] and the canvases it produces,
    [(canvas [L], the step after it)]. The first commit is the reference's decision on the row's
    prediction; the others are guesses from the same prediction (the next most confident
    candidates), stopped at `speculate` commits, the end of the schedule or a block boundary."""
    x0, conf = row.pred
    avail = conf.clone()
    chain, canvases = [], []
    canvas, i = row.canvas, row.step
    while True:
        k = counts[i]
        if chain:
            if int(torch.isfinite(avail).sum()) < k:
                break
            pos = torch.topk(avail, k).indices
        else:
            pos = decide(conf, k, start)
        tok = x0[pos]
        avail[pos] = -torch.inf
        canvas = canvas.clone()
        canvas[pos] = tok
        chain.append((i, pos, tok))
        j = next_step(counts, i + 1)
        canvases.append((canvas, j))
        if len(chain) >= speculate or j >= len(counts) or right(j) != right(i):
            break
        i = j
    return chain, canvases


def speculative_loop(family, x: torch.Tensor, prompt_len: int, gen, generator, starts=None):
    """The self-speculative loop on canvas x [B, L] in place (module docstring), as a sampler
    coroutine; returns its statistics: speculate, nfe (forwards), canvases (canvas forwards, the
    compute they took), tokens (committed, all rows), tokens_per_forward (per row), accepted
    ({steps: times}, the steps a row committed from one verification) and row_nfe."""
    B, L = x.shape
    mask_id = family.mcfg.mask_id
    counts = family.schedule(x, prompt_len, gen)                   # [B][T] tokens per step
    T = len(counts[0])
    hist = [[EMPTY] * T for _ in range(B)]                         # per row and step: (pos, tok)
    rows = [RowState(x[b].clone(), next_step(counts[b], 0)) for b in range(B)]
    right = family.right_of(prompt_len, gen, L)
    stats = {"nfe": 0, "canvases": 0, "accepted": Counter(), "row_nfe": [0] * B}
    start_of = (lambda b: starts[b]) if starts else (lambda b: 0)

    def run(canvases, owners, steps):
        ids = torch.stack(canvases)
        rights = torch.tensor([right(s) for s in steps], device=x.device)
        owners_t = torch.tensor(owners, device=x.device)
        x0s, confs = yield from family.verify(ids, rights, owners_t, gen, generator)
        stats["nfe"] += 1
        stats["canvases"] += len(canvases)
        for b in set(owners):
            stats["row_nfe"][b] += 1
        return x0s, confs

    # the first forward: every row's canvas, predicted for its first step that commits
    first = [b for b in range(B) if rows[b].step < T]
    if first:
        x0s, confs = yield from run([rows[b].canvas for b in first], first, [rows[b].step for b in first])
        for i, b in enumerate(first):
            rows[b] = RowState(rows[b].canvas, rows[b].step, (x0s[i], confs[i]))
    done = yield from _emit(x, hist, rows, 0, mask_id)
    while any(r.step < T for r in rows):
        chains = {b: draft(r, counts[b], right, family.decide, gen.speculate, start_of(b))
                  for b, r in enumerate(rows) if r.step < T}
        canvases, owners, steps, where = _verification_batch(chains, T)
        x0s = confs = None
        if canvases:
            x0s, confs = yield from run(canvases, owners, steps)
        for b, (chain, cvs) in chains.items():
            accepted = _accepted(chain, lambda m: where[(b, m)], x0s, confs,
                                 lambda conf, i: family.decide(conf, counts[b][i], start_of(b)))
            for i, pos, tok in chain[:accepted]:
                hist[b][i] = (pos, tok)
            canvas, j = cvs[accepted - 1]
            f = where.get((b, accepted - 1))
            rows[b] = RowState(canvas, j, None if f is None else (x0s[f], confs[f]))
            stats["accepted"][accepted] += 1
        done = yield from _emit(x, hist, rows, done, mask_id)
    tokens = sum(int(c[0].numel()) for h in hist for c in h if c is not EMPTY)
    return _summary(gen.speculate, stats, tokens, B, stats["row_nfe"])


def _verification_batch(chains: dict, T: int):
    """The canvases of every row's chain that need a forward (a canvas after the last step needs
    none), stacked: (canvases, owners, steps, where), where[(row, m)] = index of the m-th canvas."""
    canvases, owners, steps, where = [], [], [], {}
    for b, (_, cvs) in chains.items():
        for m, (canvas, j) in enumerate(cvs):
            if j < T:
                where[(b, m)] = len(canvases)
                canvases.append(canvas)
                owners.append(b)
                steps.append(j)
    return canvases, owners, steps, where


def _accepted(chain, index, x0s, confs, decide) -> int:
    """How many commits of chain [(step, positions, tokens)] the verification accepts: the first
    is the reference's own decision; commit m+1 is accepted while it equals decide(conf, step)
    on the prediction index(m) of the canvas after commit m."""
    accepted = 1
    while accepted < len(chain):
        f = index(accepted - 1)
        i, pos, tok = chain[accepted]
        real = decide(confs[f], i)
        if not same_positions(real, x0s[f][real], pos, tok):
            break
        accepted += 1
    return accepted


def _summary(speculate: int, stats: dict, tokens: int, B: int, row_nfe: list[int]) -> dict:
    nfe = max(1, stats["nfe"])
    return {"speculate": speculate, "nfe": stats["nfe"], "canvases": stats["canvases"], "tokens": tokens,
            "tokens_per_forward": tokens / B / nfe, "accepted": dict(sorted(stats["accepted"].items())),
            "row_nfe": row_nfe}


def lockstep_loop(family, x: torch.Tensor, prompt_len: int, gen, generator, starts=None):
    """The loop of a family whose tokens per step depend on the whole batch's masked count
    (Dream: the batch mean; it stays put where a row commits the mask token itself), in
    lockstep: every row drafts the same steps, with the counts those drafts imply, and the batch
    accepts the prefix that every row verifies. Same statistics as speculative_loop."""
    B, L = x.shape
    mask_id = family.mcfg.mask_id
    count, T = family.counter(x, gen)                 # count(step, masked over the batch) -> tokens
    stats = {"nfe": 0, "canvases": 0, "accepted": Counter(), "tokens": 0}

    def following(i, n):
        while i < T and count(i, n) == 0:
            i += 1
        return i

    def run(groups):
        ids = torch.stack([c for g in groups for c in g])
        owners = torch.arange(B, device=x.device).repeat(len(groups))
        x0s, confs = yield from family.verify(ids, torch.full((len(ids),), L, device=x.device), owners, gen,
                                              generator)
        stats["nfe"] += 1
        stats["canvases"] += len(ids)
        return [(x0s[g * B:(g + 1) * B], confs[g * B:(g + 1) * B]) for g in range(len(groups))]

    def decide_all(conf, i):
        return list(family.decide_batch(conf, int(chain[i][1][0].numel()), starts))

    canvases = [x[b].clone() for b in range(B)]
    n, done = int((x == mask_id).sum()), 0
    step = following(0, n)
    pred = (yield from run([canvases]))[0] if step < T else None
    while step < T:
        chain, cvs = _lockstep_draft(family, pred, canvases, step, n, count, following, gen.speculate, T,
                                     starts, mask_id)
        preds = yield from run([c for c, j, _ in cvs if j < T]) if any(j < T for _, j, _ in cvs) else []
        accepted = _lockstep_accepted(chain, preds, decide_all, B)
        stats["accepted"][accepted] += B
        done = yield from _lockstep_commit(x, chain[:accepted], done, stats, mask_id)
        canvases, step, n = cvs[accepted - 1]
        pred = preds[accepted - 1] if step < T else None
    while done < T:
        done += 1
        yield StepDone(int((x == mask_id).sum()))
    return _summary(gen.speculate, stats, stats["tokens"], B, [stats["nfe"]] * B)


def _lockstep_draft(family, pred, canvases, step, n, count, following, k_max, T, starts, mask_id):
    """Every row's chain from the batch's one prediction (x0 [B, L], conf [B, L]), the same steps
    for all rows: chain [(step, positions per row, tokens per row)] and the canvases it produces,
    [(canvases per row, the step after, masked count after)]."""
    x0, conf = pred
    B = len(canvases)
    avail = [c.clone() for c in conf]
    chain, cvs, cur, i = [], [], canvases, step
    while True:
        k = count(i, n)
        if chain and any(int(torch.isfinite(a).sum()) < k for a in avail):
            break
        pos = [torch.topk(avail[b], k).indices for b in range(B)] if chain else \
            list(family.decide_batch(conf, k, starts))
        tok = [x0[b][pos[b]] for b in range(B)]
        cur = [c.clone() for c in cur]
        for b in range(B):
            avail[b][pos[b]] = -torch.inf
            cur[b][pos[b]] = tok[b]
        n -= sum(int((t != mask_id).sum()) for t in tok)
        j = following(i + 1, n)
        chain.append((i, pos, tok))
        cvs.append((cur, j, n))
        if len(chain) >= k_max or j >= T:
            return chain, cvs
        i = j
    return chain, cvs


def _lockstep_accepted(chain, preds, decide_all, B: int) -> int:
    """The longest prefix of chain that every row verifies on the predictions preds[m] of the
    canvases after commit m (decide_all(conf, m + 1): the reference's decision for every row)."""
    accepted = 1
    while accepted < len(chain):
        x0f, conff = preds[accepted - 1]
        _, pos, tok = chain[accepted]
        real = decide_all(conff, accepted)
        if not all(same_positions(real[b], x0f[b][real[b]], pos[b], tok[b]) for b in range(B)):
            break
        accepted += 1
    return accepted


def _lockstep_commit(x: torch.Tensor, commits, done: int, stats: dict, mask_id: int):
    """Write the accepted commits into x one reference step at a time (a StepDone each, steps
    that commit nothing included); the new count of steps done."""
    for i, pos, tok in commits:
        while done < i:                                     # steps that commit nothing
            done += 1
            yield StepDone(int((x == mask_id).sum()))
        masked = int((x == mask_id).sum())
        for b in range(x.shape[0]):
            x[b, pos[b]] = tok[b]
        stats["tokens"] += sum(int(p.numel()) for p in pos)
        done += 1
        yield StepDone(masked)
    return done


def _emit(x: torch.Tensor, hist, rows, done: int, mask_id: int):
    """Apply to x every step that all rows have decided, one StepDone each; the new count."""
    upto = min(r.step for r in rows)
    while done < upto:
        masked = int((x == mask_id).sum())
        for b in range(x.shape[0]):
            commit = hist[b][done]
            if commit is not EMPTY:
                x[b, commit[0]] = commit[1]
        done += 1
        yield StepDone(masked)
    return done
