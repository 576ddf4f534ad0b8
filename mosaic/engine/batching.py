"""Continuous batching: many RequestRuns in flight, one planned step per compatible group.

A `Batch` holds running RequestRuns (engine/run.py), each suspended at its pending call. `step()`
groups the pending calls that can share a step program and runs each group as ONE planned step:

  plain steps (no block cache, no cfg) whose reducers compute the same thing (same signature and
  fused kernel spec, e.g. every greedy LLaDA request) and read the weights where the same offload
  mode puts them are stacked: every request's canvas [B_i, L_i] is left-padded to the group's
  longest L (the padded keys are masked, so each row attends exactly to its own tokens), its
  token positions are its own run's (so LLaDA's rotary positions do not shift with the padding),
  its masked rows are renumbered into the stacked canvas, and a StackedReducer hands each
  request's rows to its own reducer (its own random stream, in its own row order).
  everything else (block-cache steps, each with its own store; cfg; block diffusion) runs on its
  own, in the same round.

Padding rather than packing: the planned step program and its attention take [B, L] canvases
with left padding already (the published calling convention), so a padded group needs no new
kernel; the waste is the pad rows' projections and FFN (`pad_fraction` in the stats). A request
joins at the next step boundary (`add`) and leaves when its sampler ends; its tokens are the
ones it gets alone wherever each row's math does not depend on the rows beside it (the CPU in
float32: tested; on a GPU, GEMMs may pick other kernels for other row counts, so bf16 tokens can
differ: docs/SERVING.md reports the measured agreement).

Admission of the batch (`fits`): a newcomer joins only if the Admitter says the group's step
with it still fits the budget; otherwise it waits (running work is never evicted)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.step import make_step
from ..runtime.samplers.base import RowsCall
from .run import RequestRun


class StackedReducer:
    """The reducers of several requests over one stacked row list: rows [o_i, o_i + c_i) are
    request i's, reduced by its own reducer in its own coordinates (runtime/reducers.py).

    Uniform (every part's row_math() equal and not None: no random stream of its own, the same
    options that touch a row's result), the first part reduces every row: a row's result does
    not depend on whose it is, so a captured step replays for any partition of the rows.
    Otherwise each part reduces its own rows, and the step cannot be captured (the partition
    would be baked in: runtime/graphs.eligible asks `uniform`)."""

    def __init__(self, parts: list, counts: list[int]):
        self.parts, self.counts = parts, counts
        self.offsets = [sum(counts[:i]) for i in range(len(counts))]
        maths = {getattr(p, "row_math", lambda: None)() for p in parts}
        self.uniform = len(maths) == 1 and None not in maths

    def outputs(self, dtype):
        return self.parts[0].outputs(dtype)      # equal across parts: batch_key groups by them

    @property
    def fused(self):
        return self.parts[0].fused        # equal across parts: batch_key groups by it

    def signature(self):
        sigs = tuple(dict.fromkeys(p.signature() for p in self.parts))
        return sigs[0] if len(sigs) == 1 else ("stacked", sigs)

    def transient_bytes(self, m, V, dtype) -> int:
        return max(p.transient_bytes(m, V, dtype) for p in self.parts)

    def __call__(self, lg, lu, a, b, outs):
        if self.uniform:
            self.parts[0](lg, lu, a, b, outs)
            return
        for part, o, c in zip(self.parts, self.offsets, self.counts):
            s, e = max(a, o), min(b, o + c)
            if s >= e:
                continue
            part(lg[s - a:e - a], None if lu is None else lu[s - a:e - a], s - o, e - o,
                 {k: v[s - a:e - a] for k, v in outs.items()})

    def finish(self):
        for p in self.parts:
            p.finish()


def batch_key(run: RequestRun):
    """What a run's pending call must share with others to be stacked into one step (None: it
    runs on its own): plain steps, or block steps of the same block length against stores that
    live wholly on the device (a fill step, a host-tier store or cfg run alone), whose reducers
    write the same outputs through the same logits path (the fused kernel's spec, or none) and
    whose weights live where the same offload mode puts them. Options that only change how a
    row is reduced (a LLaDA request's EOS masking beside one without, Dream's algs off the
    fused kernel) or that act on the host (thresholds, steps, lengths) share the step: each
    request's rows are reduced by its own reducer (StackedReducer)."""
    call = run.pending
    if not isinstance(call, RowsCall) or call.rows_uncond is not None:
        return None
    r = call.reducer
    kind = ("plain",)
    if call.cache is not None:
        lay = run.state.store.layout
        if call.cache.mode != "block" or lay.hot < lay.num_layers:
            return None
        kind = ("block", call.cache.hi - call.cache.lo)
    dtype = run.executor.model.dtype
    return (*kind, type(r).__name__, tuple(r.outputs(dtype)), r.fused, run.state.offload)


@dataclass
class BatchStats:
    """Counters of a Batch: steps run, requests per stacked step, and the pad rows' share."""
    steps: int = 0
    stacked_steps: int = 0
    stacked_requests: int = 0
    rows: int = 0
    pad_rows: int = 0
    fallbacks: list[str] = field(default_factory=list)   # stacked steps that failed and ran one by one

    @property
    def pad_fraction(self) -> float:
        return self.pad_rows / self.rows if self.rows else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "stacked_steps": self.stacked_steps,
                "requests_per_stacked_step": self.stacked_requests / max(1, self.stacked_steps),
                "pad_fraction": self.pad_fraction}


class Batch:
    """Running requests of one engine (module docstring). max_rows: the most canvas rows
    (sequences) one stacked step may hold."""

    def __init__(self, engine, max_rows: int = 64):
        self.engine, self.max_rows = engine, max_rows
        self.runs: list[RequestRun] = []
        self.stats = BatchStats()

    def __len__(self) -> int:
        return len(self.runs)

    @property
    def rows(self) -> int:
        return sum(r.request.batch for r in self.runs)

    def fits(self, run: RequestRun) -> bool:
        """Whether the group `run` would join still fits the budget: the Admitter asked for a
        step of every running sequence plus the newcomer's, at the longest length and the
        largest canvas among them (the stacked step's worst case)."""
        if not self.runs:
            return True
        if self.rows + run.request.batch > self.max_rows:
            return False
        reqs = [r.request for r in self.runs] + [run.request]
        gen = max((q.gen for q in reqs), key=lambda g: g.max_new_tokens)
        length = max(q.length for q in reqs)
        kinds = {q.grammar is not None for q in reqs}   # constrained steps are charged as they run
        return all(self.engine.admitter.fits(sum(q.batch for q in reqs), length, gen, constrained=c) for c in kinds)

    def add(self, run: RequestRun) -> None:
        """Start `run` (its first call pending) and keep it in the batch until it ends."""
        run.start()
        self.runs.append(run)

    def step(self) -> list[tuple[RequestRun, Exception | None]]:
        """Run every running request's pending call once (stacked where they can be); returns the
        runs that ended in this round with the error that ended them (None: their result() is
        ready). They leave the batch; the others go on."""
        groups, alone = self._groups()
        failed: dict[int, Exception] = {}
        for group in groups:
            alone += self._run_group(group, failed)
        for run in alone:
            if id(run) in failed or run.done:
                continue
            try:
                run.run_pending()
            except Exception as e:  # noqa: BLE001  (the request's error, reported with it)
                failed[id(run)] = e
            self.stats.steps += 1
        ended = [(r, failed.get(id(r))) for r in self.runs if r.done or id(r) in failed]
        self.runs = [r for r in self.runs if not (r.done or id(r) in failed)]
        for run, err in ended:
            if err is not None:
                run.close()
        return ended

    def _groups(self) -> tuple[list[list[RequestRun]], list[RequestRun]]:
        """(groups of two or more runs whose pending calls stack, the runs that go alone)."""
        groups: dict = {}
        alone = []
        stack = self.engine.config.sparse is None     # block-sparse steps count dense steps per request
        for run in self.runs:
            key = batch_key(run) if stack else None
            (alone if key is None else groups.setdefault(key, [])).append(run)
        multi = [g for g in groups.values() if len(g) > 1]
        return multi, alone + [g[0] for g in groups.values() if len(g) == 1]

    def _run_group(self, group: list[RequestRun], failed: dict) -> list[RequestRun]:
        """One stacked step for the group's live runs; the runs left to go alone (a cancelled run
        is recorded in `failed`; a stacked step that fails runs its requests one by one)."""
        live = [r for r in group if not _cancelled(r, failed)]
        if len(live) < 2:
            return live
        try:
            outs = self._stacked(live)
        except Exception as e:  # noqa: BLE001  (each runs on its own, reporting its own error)
            self.stats.fallbacks.append(f"{type(e).__name__}: {str(e)[:200]}")
            return live
        for run, out in zip(live, outs):
            try:
                run.advance(out)
            except Exception as e:  # noqa: BLE001
                failed[id(run)] = e
        self.stats.steps += 1
        return []

    def _stacked(self, runs: list[RequestRun]) -> list[dict]:
        """One planned step for the pending RowsCalls of `runs` (module docstring): each run's
        outputs, in order (not yet sent to the runs)."""
        cfg, dtype = self.engine.model.cfg, self.engine.model.dtype
        calls = [r.pending for r in runs]
        if calls[0].cache is not None:
            return self._stacked_blocks(runs, calls)
        L = max(c.ids.shape[1] for c in calls)
        ids, valid, pos, rows, counts = [], [], [], [], []
        off = 0
        for run, call in zip(runs, calls):
            Bi, Li = call.ids.shape
            p = L - Li
            vr = run.state.valid           # several canvases of one row (self-speculative): that row's padding
            vr = vr[call.canvas_rows] if vr is not None and call.canvas_rows is not None else vr
            v = vr if vr is not None else torch.ones(Bi, Li, dtype=torch.bool, device=call.ids.device)
            own = make_step(cfg, call.ids, vr, dtype=dtype).positions   # the run's own positions
            fill = torch.zeros(Bi, p, dtype=call.ids.dtype, device=call.ids.device)
            ids.append(torch.cat([fill, call.ids], 1))
            valid.append(torch.cat([torch.zeros(Bi, p, dtype=torch.bool, device=v.device), v], 1))
            pos.append(torch.cat([torch.zeros(Bi, p, dtype=own.dtype, device=own.device), own], 1))
            r = call.rows
            rows.append((off + r // Li) * L + r % Li + p)
            counts.append(int(r.shape[0]))
            off += Bi
        ids, valid, pos, rows = torch.cat(ids), torch.cat(valid), torch.cat(pos), torch.cat(rows)
        reducer = StackedReducer([c.reducer for c in calls], counts)
        outs = self.engine.executor.stacked(ids, valid, pos, rows, reducer, runs[0].state.offload)
        self.stats.stacked_steps += 1
        self.stats.stacked_requests += len(runs)
        self.stats.rows += int(ids.numel())
        self.stats.pad_rows += int((~valid).sum())
        bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]
        return [{k: v[bounds[i]:bounds[i + 1]] for k, v in outs.items()} for i in range(len(runs))]

    def _stacked_blocks(self, runs: list[RequestRun], calls) -> list[dict]:
        """One block step of several requests' block caches (models/stacked_cache.py)."""
        parts, rows, counts, off = [], [], [], 0
        n = calls[0].cache.hi - calls[0].cache.lo
        for run, call in zip(runs, calls):
            parts.append((call.ids, run.state.valid, call.cache.lo, call.cache.hi, run.state.store))
            rows.append(call.rows + off * n)          # rows index each request's B_i x n block rows
            counts.append(int(call.rows.shape[0]))
            off += call.ids.shape[0]
        reducer = StackedReducer([c.reducer for c in calls], counts)
        outs = self.engine.executor.stacked_blocks(parts, torch.cat(rows), reducer, runs[0].state.offload)
        self.stats.stacked_steps += 1
        self.stats.stacked_requests += len(runs)
        self.stats.rows += off * n
        bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]
        return [{k: v[bounds[i]:bounds[i + 1]] for k, v in outs.items()} for i in range(len(runs))]

    def run_all(self) -> list:
        """Step until every run ended; their Generations in the order they were added (raises
        the first request's error, if one failed)."""
        order, errors = list(self.runs), {}
        while self.runs:
            for run, err in self.step():
                if err is not None:
                    errors[id(run)] = err
        out = []
        for run in order:
            if id(run) in errors:
                raise errors[id(run)]
            run.close()
            out.append(run.result())
        return out


def _cancelled(run: RequestRun, failed: dict) -> bool:
    """A cancelled run leaves the group before its step (recorded in `failed`)."""
    try:
        run.check_cancelled()
        return False
    except Exception as e:  # noqa: BLE001
        failed[id(run)] = e
        return True
