"""Canvas-aware constrained sampling: the one object every sampler consults (docs/STRUCTURED.md).

The rule (the simple canvas-aware rule of the diffusion constrained-decoding literature; DINGO,
arXiv 2505.23061, decodes regular constraints by dynamic programming over the same token-level
DFA): a position of the answer may be committed only when every position before it is committed
and the grammar allows its token there with room left to finish. Several consecutive positions
may be committed in one step. So the committed canvas always spells a prefix the grammar accepts
(a state of the DFA, runtime/grammar.py) from which an accepting state is at most as many tokens
away as positions remain: the finished answer parses.

A sampler makes three calls, each a no-op without a constraint (C None):

  window(C, cand, counts)  the candidates of a step restricted to each row's next free positions
                           (its frontier and the positions after it, at most counts[b] or
                           WINDOW of them): only their logits are computed
  settle(C, transfer, run) the sampler's chosen positions made a prefix of the window: its count
                           n of them (count rules: the first n), or (run=True, threshold rules)
                           the longest run of chosen positions from the frontier, at least one
  C.commit(x)              after the sampler wrote its commits: each row's DFA state advanced over
                           them; after an end-of-text, the rest of the answer filled with it

and `C.wrap(predict)` makes the predict's planned calls reduce through `ConstrainedReducer`: the
family reducer runs on the window's logits as usual; a host walk then checks each row's token
against the DFA state the rows before it reach, and a row whose token is not allowed is reduced
again from its logits with the disallowed tokens at -inf (the family's own math: argmax, Gumbel
or top-p draws, confidences over the allowed tokens)."""

from __future__ import annotations

import dataclasses
import inspect

import torch

from .base import BlockCall, RowsCall

WINDOW = 16    # positions a threshold rule may commit in one step (its window's logits: 16 x V)


class CanvasConstraint:
    """One request's constraint: grammar (runtime/grammar.Grammar), spans [(lo, hi)] per row (the
    answer's canvas columns), mask_id, eos_ids (every end-of-text id), label (Generation.lossy)."""

    def __init__(self, grammar, spans: list[tuple[int, int]], mask_id: int, eos_ids=(), label: str = ""):
        self.g, self.mask_id, self.label = grammar, mask_id, label
        self.eos_ids = frozenset(eos_ids) | {grammar.eos}
        self.state = [grammar.initial] * len(spans)
        self.front = [lo for lo, _ in spans]
        self.end = [hi for _, hi in spans]
        self.positions_masked = 0        # rows reduced again under a mask (statistics)

    # -- the sampler's calls
    def restrict(self, cand: torch.Tensor, counts=None, a: int = 0) -> torch.Tensor:
        """cand [B, n] over canvas columns [a, a + n) -> per row the run of candidates starting at
        its frontier, at most counts[b] (or WINDOW) long."""
        out = torch.zeros_like(cand)
        host = cand.cpu()
        for b in range(cand.shape[0]):
            lo = self.front[b] - a
            if self.front[b] >= self.end[b] or not 0 <= lo < cand.shape[1]:
                continue
            w = WINDOW if counts is None else int(counts[b])
            hi = min(lo + w, self.end[b] - a, cand.shape[1])
            run = 0
            while lo + run < hi and bool(host[b, lo + run]):
                run += 1
            out[b, lo:lo + run] = True
        return out

    def prefix(self, transfer: torch.Tensor, run: bool = False, a: int = 0, seqs=None) -> torch.Tensor:
        """transfer [B, n] -> the same count per row taken from the frontier (run: the longest run
        of chosen positions from it, at least one when the row chose any); seqs: the request row
        of each row of transfer (default: the same)."""
        out = torch.zeros_like(transfer)
        host = transfer.cpu()
        for i in range(transfer.shape[0]):
            b = i if seqs is None else seqs[i]
            n = int(host[i].sum())
            lo = self.front[b] - a
            if n == 0 or not 0 <= lo < transfer.shape[1]:
                continue
            if run:
                k = 0
                while lo + k < transfer.shape[1] and bool(host[i, lo + k]):
                    k += 1
                n = max(k, 1)
            out[i, lo:min(lo + n, self.end[b] - a)] = True
        return out

    def commit(self, x: torch.Tensor, a: int = 0) -> None:
        """Advance each row over its newly committed positions of x [B, n] (canvas columns
        [a, a + n)); after an end-of-text the rest of the row's answer becomes end-of-text."""
        host = x.cpu()
        for b in range(x.shape[0]):
            while self.front[b] < self.end[b]:
                tok = int(host[b, self.front[b] - a])
                if tok == self.mask_id:
                    break
                if tok in self.eos_ids:
                    x[b, self.front[b] - a:self.end[b] - a] = tok
                    self.front[b] = self.end[b]
                    break
                self.state[b] = self.g.advance(self.state[b], tok)
                self.front[b] += 1

    def count_masked(self) -> None:
        """One more row reduced again under a mask (statistics)."""
        self.positions_masked += 1

    def complete(self) -> bool:
        """Whether every row's answer is in an accepting state or ended."""
        return all(f >= e and (s in self.g.finals) for f, e, s in zip(self.front, self.end, self.state)) or \
            all(f >= e for f, e in zip(self.front, self.end))

    # -- the reducer
    def wrap(self, predict):
        """predict (a function or generator function of the planned path) -> the same, with every
        RowsCall / BlockCall it yields reduced through ConstrainedReducer."""
        def wrapped(*args, **kwargs):
            result = predict(*args, **kwargs)
            if not inspect.isgenerator(result):
                return result
            return self._through(result)
        return wrapped

    def constrain(self, call):
        """A RowsCall / BlockCall reduced through ConstrainedReducer (other calls as they are)."""
        if isinstance(call, RowsCall):
            width = call.cache.hi - call.cache.lo if call.cache is not None and call.cache.mode == "block" \
                else call.ids.shape[1]
            return dataclasses.replace(call, reducer=ConstrainedReducer(call.reducer, self, call.rows, width))
        if isinstance(call, BlockCall):
            width = call.hi - call.a
            return dataclasses.replace(call, reducer=ConstrainedReducer(call.reducer, self, call.rows, width))
        return call

    def _through(self, gen):
        outs = None
        try:
            while True:
                outs = yield self.constrain(gen.send(outs))
        except StopIteration as stop:
            return stop.value


class ConstrainedReducer:
    """The family reducer `inner` over a window's rows (rows [M] flat over B x width, ascending:
    each row's window in position order), then the DFA walk (module docstring). Host decisions
    between chunks: never captured in a CUDA graph (`host_walk`), never stacked with other
    requests (its own signature), always on the buffer path (the logits of the window's rows,
    m x V, exist; the walk re-reduces single rows of a saved copy)."""
    host_walk = True
    fused = None

    def __init__(self, inner, constraint: CanvasConstraint, rows: torch.Tensor, width: int):
        self.inner, self.c = inner, constraint
        self.seq = (rows // width).tolist()
        self.cur: dict[int, list] = {}       # row -> [state, position, ended]

    def __getattr__(self, name):            # g, gen, positions ...: the family reducer's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def subset(self, idx):
        return self

    def outputs(self, dtype):
        return self.inner.outputs(dtype)

    def signature(self):
        return ("constrained", id(self))

    def transient_bytes(self, m, V, dtype) -> int:
        # the inner reducer's, plus the saved copy of the chunk's logits (and a row's masked copy)
        isz = torch.empty((), dtype=dtype).element_size()
        return self.inner.transient_bytes(m, V, dtype) + (m + 1) * V * (isz + 1)

    def finish(self):
        self.inner.finish()

    def __call__(self, lg, lu, a, b, outs):
        saved = lg.clone()
        saved_u = None if lu is None else lu.clone()
        self.inner(lg, lu, a, b, outs)
        x0 = outs["x0"].tolist()
        g, c = self.c.g, self.c
        for j in range(b - a):
            seq = self.seq[a + j]
            cur = self.cur.setdefault(seq, [c.state[seq], c.front[seq], False])
            left = c.end[seq] - cur[1] - 1
            if cur[2]:                                     # after an end-of-text: end-of-text
                outs["x0"][j] = g.eos
            elif not g.allows(cur[0], x0[j], left):
                row = saved[j:j + 1]
                row.masked_fill_(~g.mask(cur[0], left, row.device), -torch.inf)
                one = {k: v[j:j + 1] for k, v in outs.items()}
                self.inner(row, None if saved_u is None else saved_u[j:j + 1], a + j, a + j + 1, one)
                x0[j] = int(one["x0"][0])
                c.count_masked()
                assert g.allows(cur[0], x0[j], left), "a masked reduction chose a disallowed token"
            tok = int(outs["x0"][j]) if cur[2] else x0[j]
            if tok in c.eos_ids:
                cur[2] = True
            else:
                cur[0] = g.advance(cur[0], tok)
            cur[1] += 1


def window(c: CanvasConstraint | None, cand: torch.Tensor, counts=None, a: int = 0) -> torch.Tensor:
    """c.restrict(cand, counts, a), or cand itself without a constraint."""
    return cand if c is None else c.restrict(cand, counts, a)


def settle(c: CanvasConstraint | None, transfer: torch.Tensor, run: bool = False, a: int = 0) -> torch.Tensor:
    """c.prefix(transfer, run, a), or transfer itself without a constraint."""
    return transfer if c is None else c.prefix(transfer, run, a)


def committed(c: CanvasConstraint | None, x: torch.Tensor, a: int = 0) -> None:
    """c.commit(x, a) when there is a constraint."""
    if c is not None:
        c.commit(x, a)


def constraint_of(predict) -> CanvasConstraint | None:
    """The constraint a predict function carries (base.Predict), or None."""
    return getattr(predict, "constraint", None)
