"""The reducer of a constrained step, in two halves (docs/STRUCTURED.md):

  on the device, inside the step (`ConstrainedReducer.__call__`): the window's logits are copied
      into a step output ('logits' [M, V], 'logits_u' with cfg), then the family reducer runs on
      them as usual (argmax, Gumbel, top-p, confidences). Nothing reads the host, so the step can
      be captured in a CUDA graph and replayed like an unconstrained one (runtime/graphs.py).
  on the host, after the step (`walk`): one readback of the window's tokens (with their row
      indices); each row's token is checked against the DFA state the rows before it reach; a
      row whose token is not allowed is reduced again from its saved logits with the disallowed
      tokens at -inf (the family's own math), which costs one more readback for that row (the
      next row's state depends on its token). While the step runs on the GPU, the host builds the
      masks of each row's frontier state (`Grammar.prefetch`).

This computes what the earlier in-step walk computed (a host walk after each logits chunk): the
same tokens and confidences (tests/engine/test_constraint_walk.py runs both). The order of random
draws differs only when a step's logits run in several chunks and a row is masked (a re-reduction
now follows every chunk's draws).

Device bytes beyond the family reducer's (policy/admission charges them, `after_bytes`): the
saved logits in the plan (M x V x itemsize), the runner's copy of the step's outputs once the step
ends, and one masked row's re-reduction (a V-byte mask of banned tokens plus the family reducer's
transients for one row)."""

from __future__ import annotations

import math

import torch

from .. import published as P

SAVED = ("logits", "logits_u")


class ConstrainedReducer:
    """The family reducer `inner` over a window's rows (rows [M] flat over B x width, ascending:
    each row's window in position order), saving the window's logits for `walk`. constraint:
    the request's CanvasConstraint (None: an admission probe, which is never walked); vocab: V,
    the LM head's width; cfg: the step also runs an unconditional copy (its logits saved too)."""

    def __init__(self, inner, constraint, rows: torch.Tensor, width: int, vocab: int, cfg: bool = False):
        self.inner, self.c = inner, constraint
        self.rows, self.width, self.V, self.cfg = rows, width, vocab, cfg

    def __getattr__(self, name):            # g, gen, positions ...: the family reducer's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    fused = None      # the logits must exist: the buffer path

    def subset(self, idx):
        return self

    def outputs(self, dtype):
        saved = [("logits", dtype, self.V)] + ([("logits_u", dtype, self.V)] if self.cfg else [])
        return list(self.inner.outputs(dtype)) + saved

    def signature(self):
        # stable across steps: one template (and one captured graph) per step shape, as unconstrained
        return ("constrained", self.cfg, self.inner.signature())

    def row_math(self):
        inner = getattr(self.inner, "row_math", lambda: None)()
        return None if inner is None else ("constrained", self.cfg, inner)

    def transient_bytes(self, m, V, dtype) -> int:
        return self.inner.transient_bytes(m, V, dtype)     # the copy goes into planned outputs

    def after_bytes(self, M, V, dtype) -> int:
        """Device bytes after the step while its arena is still mapped: the runner's copy of every
        output (the saved logits included) and one masked row's re-reduction (its V-byte mask of
        banned tokens and the family reducer's transients for one row)."""
        out = 0
        for _, dt, *width in self.outputs(dtype):
            out += M * (width[0] if width else 1) * torch.empty((), dtype=dt).element_size()
        return out + V + self.inner.transient_bytes(1, V, dtype)

    def finish(self):
        self.inner.finish()

    def __call__(self, lg, lu, a, b, outs):
        outs["logits"].copy_(lg)          # before the family reducer, which may edit lg in place
        if lu is not None:
            outs["logits_u"].copy_(lu)
        self.inner(lg, lu, a, b, outs)

    # -- after the step, on the host
    def prefetch(self) -> None:
        """The host masks of every row's frontier state, built while the device computes."""
        c = self.c
        for s, f, e in zip(c.state, c.front, c.end):
            if f < e:
                c.g.prefetch(s, e - f - 1)

    def walk(self, outs: dict) -> dict:
        """outs of the step (x0, conf, logits [, logits_u]) -> the same without the saved logits,
        every row's token allowed where the rows before it leave its state (module docstring).
        Records each row's walked tokens on the constraint (CanvasConstraint.commit reads them
        instead of the canvas). Under a threshold rule (constraint.stop) a row's walk stops after
        its first position whose confidence is below the threshold: the rule's run from the
        frontier ends there, so the positions after it are never committed this step and keep
        their free tokens (never read)."""
        logits, logits_u = outs.pop("logits"), outs.pop("logits_u", None)
        M = outs["x0"].shape[0]
        if M == 0:
            return outs
        c, g = self.c, self.c.g
        stop = None if c.stop is None or "conf" not in outs else torch.tensor(c.stop, dtype=outs["conf"].dtype).item()
        cols = [outs["x0"], self.rows.to(outs["x0"].device)] + ([outs["conf"]] if stop is not None else [])
        host = torch.stack([t.double() for t in cols]).tolist()          # the step's readback
        x0, seqs = [int(t) for t in host[0]], [int(r) // self.width for r in host[1]]
        conf = host[2] if stop is not None else None
        cur: dict[int, list] = {}       # seq -> [state, position, ended]
        ended_rows = []
        for j in range(M):
            seq = seqs[j]
            if seq in c.stopped:
                continue
            st = cur.setdefault(seq, [c.state[seq], c.front[seq], False])
            left = c.end[seq] - st[1] - 1
            if st[2]:                                      # after an end-of-text: end-of-text
                x0[j] = g.eos
                ended_rows.append(j)
            elif not g.allows(st[0], x0[j], left):
                x0[j], cf = self._masked(outs, logits, logits_u, j, st[0], left, stop is not None)
                if conf is not None:
                    conf[j] = cf
            c.pending.setdefault(seq, []).append(x0[j])
            if x0[j] in c.eos_ids:
                st[2] = True
            else:
                st[0] = g.advance(st[0], x0[j])
            st[1] += 1
            if conf is not None and conf[j] < stop:     # the threshold run ends at this row
                c.stopped.add(seq)
        if ended_rows:
            outs["x0"][torch.tensor(ended_rows, device=outs["x0"].device)] = g.eos
        return outs

    def _masked(self, outs, logits, logits_u, j: int, state: int, left: int, with_conf: bool):
        """Row j reduced again from its saved logits with the tokens `state` does not allow (with
        `left` positions after it) at -inf: (its token, its confidence or None), one readback."""
        g = self.c.g
        row = logits[j:j + 1]
        row.masked_fill_(g.banned(state, left, row.device), -torch.inf)
        one = {k: v[j:j + 1] for k, v in outs.items()}
        self.inner(row, None if logits_u is None else logits_u[j:j + 1], j, j + 1, one)
        if with_conf:
            tok, cf = torch.stack([one["x0"].double(), one["conf"].double()]).flatten().tolist()
            tok = int(tok)
            if math.isnan(cf):     # the reducer leaves the NaN test to the step's (run before this)
                raise P.nan_error(row.dtype)
        else:
            tok, cf = int(one["x0"][0]), None
        self.c.count_masked()
        assert g.allows(state, tok, left), "a masked reduction chose a disallowed token"
        return tok, cf
