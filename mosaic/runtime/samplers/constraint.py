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

and `C.wrap(predict)` makes the predict's planned calls reduce through `ConstrainedReducer`
(samplers/constrained_reducer.py): the family reducer runs on the window's logits as usual inside
the step (which may be a captured graph), and after it a host walk checks each row's token against
the DFA state the rows before it reach; a row whose token is not allowed is reduced again from its
saved logits with the disallowed tokens at -inf (the family's own math: argmax, Gumbel or top-p
draws, confidences over the allowed tokens).

Host reads (each a device sync on a GPU) of a constrained step: the window's candidates (with the
step's counts), the walk's tokens, the rule's choice (its tie read and the chosen positions), and
one more per row the walk masks. `commit` reads nothing: the walk recorded the tokens. The masks
[B, n] bool that window and settle return are built on the host and copied (the sampler's
per-token tensors: memory/accounting.py INPUT_BYTES_PER_TOKEN)."""

from __future__ import annotations

import dataclasses
import inspect

import torch

from .base import BlockCall, RowsCall
from .constrained_reducer import ConstrainedReducer

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
        self.pending: dict[int, list[int]] = {}   # row -> the walk's tokens from its frontier (this step)
        self.granted: dict[int, int] = {}         # row -> positions settle let it commit (this step)
        self.stop: float | None = None            # this step's threshold rule: a walk may stop below it
        self.stopped: set[int] = set()            # rows whose walk stopped early (this step)

    # -- the sampler's calls
    def restrict(self, cand: torch.Tensor, counts=None, a: int = 0, stop: float | None = None) -> torch.Tensor:
        """cand [B, n] over canvas columns [a, a + n) -> per row the run of candidates starting at
        its frontier, at most counts[b] (or WINDOW) long. One host read (cand, with counts when
        they are a device tensor). stop: the step commits by the threshold rule at `stop` (the
        run of positions from the frontier at or above it, at least one): the walk may stop after
        the first row below it, whose successors cannot be committed (constrained_reducer.py)."""
        self.stop = stop
        host, counts = _read(cand, counts)
        B, n = cand.shape
        out = torch.zeros(B, n, dtype=torch.bool)
        for b in range(B):
            lo = self.front[b] - a
            if self.front[b] >= self.end[b] or not 0 <= lo < n:
                continue
            w = WINDOW if counts is None else int(counts[b])
            hi = min(lo + w, self.end[b] - a, n)
            run = 0
            while lo + run < hi and host[b][lo + run]:
                run += 1
            out[b, lo:lo + run] = True
        return out.to(cand.device)

    def prefix(self, transfer: torch.Tensor, run: bool = False, a: int = 0, seqs=None) -> torch.Tensor:
        """transfer [B, n] -> the same count per row taken from the frontier (run: the longest run
        of chosen positions from it, at least one when the row chose any); seqs: the request row
        of each row of transfer (default: the same). One host read."""
        host = transfer.tolist()
        out = torch.zeros(transfer.shape, dtype=torch.bool)
        for i, chosen in enumerate(host):
            b = i if seqs is None else seqs[i]
            n = sum(chosen)
            lo = self.front[b] - a
            if n == 0 or not 0 <= lo < transfer.shape[1]:
                continue
            if run:
                k = 0
                while lo + k < transfer.shape[1] and chosen[lo + k]:
                    k += 1
                n = max(k, 1)
            hi = min(lo + n, self.end[b] - a)
            if b in self.stopped:       # never past the rows the walk checked (it stopped below the threshold)
                hi = min(hi, lo + len(self.pending.get(b, ())))
            out[i, lo:hi] = True
            self.granted[b] = hi - lo
        return out.to(transfer.device)

    def commit(self, x: torch.Tensor, a: int = 0) -> None:
        """Advance each row over its newly committed positions of x [B, n] (canvas columns
        [a, a + n)); after an end-of-text the rest of the row's answer becomes end-of-text. A row
        that settle let commit g positions and that the walk gave tokens advances over those
        tokens without reading x (the sampler wrote them there); any other row reads x (once)."""
        host = None
        for b in range(x.shape[0]):
            if self.front[b] >= self.end[b]:
                continue
            toks = self.pending.get(b)
            if b in self.granted and toks is not None:
                toks = toks[:self.granted[b]]     # positions past the walked window stay masked
            else:
                host = x.tolist() if host is None else host
                toks = host[b][self.front[b] - a:self.end[b] - a]
            for tok in toks:
                if tok == self.mask_id:
                    break
                if tok in self.eos_ids:
                    x[b, self.front[b] - a:self.end[b] - a] = tok
                    self.front[b] = self.end[b]
                    break
                self.state[b] = self.g.advance(self.state[b], tok)
                self.front[b] += 1
        self.pending.clear()
        self.granted.clear()
        self.stopped.clear()

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
        self.pending.clear()
        self.granted.clear()
        self.stopped.clear()
        if isinstance(call, RowsCall):
            width = call.cache.hi - call.cache.lo if call.cache is not None and call.cache.mode == "block" \
                else call.ids.shape[1]
            reducer = ConstrainedReducer(call.reducer, self, call.rows, width, self.g.V, call.rows_uncond is not None)
            return dataclasses.replace(call, reducer=reducer)
        if isinstance(call, BlockCall):
            width = call.hi - call.a
            return dataclasses.replace(call, reducer=ConstrainedReducer(call.reducer, self, call.rows, width, self.g.V))
        return call

    def run(self, call):
        """`outs = yield from C.run(call)`: the call reduced through ConstrainedReducer, its
        outputs walked (constrained_reducer.py) before the sampler reads them."""
        call = self.constrain(call)
        outs = yield call
        r = getattr(call, "reducer", None)
        if not isinstance(r, ConstrainedReducer):
            return outs
        if outs["x0"].device.type == "cuda":   # the host is free while the device computes
            r.prefetch()
        return r.walk(outs)

    def _through(self, gen):
        outs = None
        try:
            while True:
                outs = yield from self.run(gen.send(outs))
        except StopIteration as stop:
            return stop.value


def _read(cand: torch.Tensor, counts):
    """(cand as host lists, counts as host ints or None): one read when counts is a device tensor."""
    if isinstance(counts, torch.Tensor):
        k = counts.reshape(-1, 1).to(device=cand.device, dtype=torch.long).expand(cand.shape[0], 1)
        rows = torch.cat([cand.long(), k], 1).tolist()
        return [r[:-1] for r in rows], [r[-1] for r in rows]
    return cand.tolist(), counts


def window(c: CanvasConstraint | None, cand: torch.Tensor, counts=None, a: int = 0,
           stop: float | None = None) -> torch.Tensor:
    """c.restrict(cand, counts, a, stop), or cand itself without a constraint."""
    return cand if c is None else c.restrict(cand, counts, a, stop)


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
