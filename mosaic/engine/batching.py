"""The round executor: one scheduler round over many RequestRuns, one planned step per compatible
group.

`RoundExecutor.run_round(work)` runs the pending call of each run in `work` once (the Scheduler,
engine/scheduler.py, decides who is in the round; nothing here decides who runs) and returns per
item the call's outputs, not yet sent back to the run (the Scheduler does that), None for a slice
of a fill that did not finish the call (chunked joining, engine/fills.py), or the Exception that
ended the run. It groups the pending calls that can share a step program and runs each group as
ONE planned step:

  plain steps (no block cache, no cfg) whose reducers compute the same thing (same signature and
  fused kernel spec, e.g. every greedy LLaDA request) and read the weights where the same offload
  mode puts them are stacked: every request's canvas [B_i, L_i] is left-padded to the group's
  longest L (the padded keys are masked, so each row attends exactly to its own tokens), its
  token positions are its own run's (so LLaDA's rotary positions do not shift with the padding),
  its masked rows are renumbered into the stacked canvas, and a StackedReducer hands each
  request's rows to its own reducer (its own random stream, in its own row order).
  block steps of Fast-dLLM caches with the same block length are stacked the same way, each
  sequence attending over its own store (models/stacked_cache.py), and so are fills of one
  length (a fill is the block step of every row).
  block steps of block-diffusion requests (LLaDA2) with the same block length and rows, whose
  stores live in the engine's paged K/V pool, stack into one step over the pool, each sequence at
  its own block position (models/block_cache.stacked_diffusion_step).
  constrained steps stack with constrained steps: the step saves their logits and reduces them as
  the family does; each run walks its own grammar over its own rows after the step
  (runtime/samplers/constrained_reducer.py).
  everything else (fills of padded canvases, cfg, host-tier stores, native forwards, and sampled
  steps on the GPU's fused kernel, whose Gumbel stream is keyed by a row's
  index in the step) runs on its own, in the same round.

Padding rather than packing: the planned step program and its attention take [B, L] canvases
with left padding already (the published calling convention), so a padded group needs no new
kernel; the waste is the pad rows' projections and FFN (`pad_fraction` in the stats). A run's
tokens are the ones it gets alone wherever each row's math does not depend on the rows beside it
(the CPU in float32: tested; on a GPU, GEMMs may pick other kernels for other row counts, so bf16
tokens can differ unless batch_invariant is on: docs/SERVING.md). A stacked step stops between two
ops once every run in it is cancelled (a shutdown waited ~60 s for 6 cancelled 11k-token requests on a
CPU); a cancelled run among others leaves at its end. Nothing
here reads the device: each request's NaN test is its own rows' flag, left on the device and read
with its own readback (a NaN fails that request only), so the host never waits for the step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import StepInterrupted
from ..kernels.host_ints import repeated_on
from ..models.step import make_step
from ..runtime.samplers.base import BlockCall, RowsCall
from .fills import FillSlices
from .run import RequestCancelled, RequestRun


@dataclass(frozen=True)
class Work:
    """One run's share of a round: its pending call whole (layers None), or layers [a, b) of its
    pending fill (chunked joining; the Scheduler chose the slice)."""
    run: RequestRun
    layers: tuple[int, int] | None = None


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
        if hasattr(parts[0], "after_bytes"):     # constrained parts: what follows the step (graph/ctx.py)
            self.after_bytes = lambda M, V, dtype: max(p.after_bytes(M, V, dtype) for p in parts)

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
    live wholly on the device, fills of one length among them (a padded fill, a host-tier store,
    cfg or a fused sampled step run alone), whose reducers write the same outputs through the
    same logits path (the fused kernel's spec, or none) and whose weights live where the same
    offload mode puts them; block-diffusion block steps of one block length and row count over
    one paged pool. Options that only change how a row is reduced (a LLaDA request's EOS
    masking beside one without, Dream's algs off the fused kernel) or that act on the host
    (thresholds, steps, lengths) share the step: each request's rows are reduced by its own
    reducer (StackedReducer)."""
    call = run.pending
    if isinstance(call, BlockCall):      # block diffusion: block steps of n rows over one paged pool
        pool = getattr(run.state.store, "pool", None)
        r = call.reducer
        if pool is None or type(r).__name__ != "BlockReducer":   # a constrained request runs alone
            return None
        return ("diffusion", run.canvas.block, call.hi - call.a, id(pool), r.signature())
    if not isinstance(call, RowsCall) or call.rows_uncond is not None:
        return None
    r = call.reducer
    fused = r.fused
    if fused is not None and fused.temperature > 0:
        # the fused kernel keys its Gumbel stream on (the first part's seed, the row's index in
        # the step): stacked, a request would draw another request's stream at other counters
        return None
    kind = ("plain",)
    if call.cache is not None:
        lay = run.state.store.layout
        if lay.hot < lay.num_layers or (call.cache.mode == "fill" and run.state.valid is not None):
            return None
        # a fill is the block step of rows [0, L): it writes every row's K/V into the store and
        # attends over it (models/kv_cache.py), so fills of one length stack as block steps do
        # (a padded canvas's fill runs alone: Dream zeroes its padded query rows)
        kind = ("block", call.cache.hi - call.cache.lo)
    dtype = run.executor.model.dtype
    return (*kind, type(r).__name__, tuple(r.outputs(dtype)), r.fused, run.state.offload)


@dataclass
class BatchStats:
    """Counters of the round executor: steps run, requests per stacked step, and the pad rows' share."""
    steps: int = 0
    stacked_steps: int = 0
    stacked_requests: int = 0
    rows: int = 0
    pad_rows: int = 0
    fill_slices: int = 0          # slices of fills run (chunked joining)
    fallbacks: list[str] = field(default_factory=list)   # stacked steps that failed and ran one by one

    @property
    def pad_fraction(self) -> float:
        return self.pad_rows / self.rows if self.rows else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "stacked_steps": self.stacked_steps,
                "requests_per_stacked_step": self.stacked_requests / max(1, self.stacked_steps),
                "pad_fraction": self.pad_fraction, "fill_slices": self.fill_slices}


class RoundExecutor:
    """Runs the Scheduler's rounds on one engine (module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.stats = BatchStats()
        self.fills = FillSlices(engine)

    def run_round(self, work: list[Work]) -> list:
        """Every item's call once (stacked where they can be): per item its outputs, None (a fill
        slice that did not finish its call) or the Exception that ended the run, in order."""
        out: dict[int, object] = {}
        whole = [w.run for w in work if w.layers is None]
        groups, alone = self._groups(whole) if len(whole) > 1 else ([], whole)
        for group in groups:
            alone += self._run_group(group, out)
        for run in alone:
            out[id(run)] = _outcome(run.execute_pending)
            run.hold_checks()        # its step's NaN test is read by its own readback, not the next run's
            self.stats.steps += 1
        for w in work:
            if w.layers is not None:
                out[id(w.run)] = _outcome(lambda w=w: self.fills.run(w.run, *w.layers))
                w.run.hold_checks()
                self.stats.fill_slices += 1
        return [out[id(w.run)] for w in work]

    def drop(self, run: RequestRun) -> None:
        """Forget what the executor holds for a run that left (a fill's residual stream)."""
        self.fills.drop(run)

    def _groups(self, runs: list[RequestRun]) -> tuple[list[list[RequestRun]], list[RequestRun]]:
        """(groups of two or more runs whose pending calls stack, the runs that go alone)."""
        groups: dict = {}
        alone = []
        stack = self.engine.config.sparse is None     # block-sparse steps count dense steps per request
        for run in runs:
            key = batch_key(run) if stack else None
            (alone if key is None else groups.setdefault(key, [])).append(run)
        multi = [g for g in groups.values() if len(g) > 1]
        return multi, alone + [g[0] for g in groups.values() if len(g) == 1]

    def _run_group(self, group: list[RequestRun], out: dict) -> list[RequestRun]:
        """One stacked step for the group (their outputs into `out`); the runs left to go alone
        (a stacked step that fails runs its requests one by one, each reporting its own error)."""
        try:
            outs = self._stacked(group)
        except StepInterrupted as e:      # every run in it was cancelled inside the step
            out.update({id(r): RequestCancelled(f"request cancelled during step {r.steps_done + 1} of "
                                                f"{r.total_steps} ({e})") for r in group})
            return []
        except Exception as e:  # noqa: BLE001  (each runs on its own, reporting its own error)
            self.stats.fallbacks.append(f"{type(e).__name__}: {str(e)[:200]}")
            return group
        dtype = self.engine.model.dtype
        for run, (o, nan) in zip(group, outs):
            out[id(run)] = o
            # its own rows' NaN test, read with its own readback (Executor.execute): a NaN in one
            # request's rows fails that request only, and nobody waits for the step here
            run.hold_checks([] if nan is None else [(nan, dtype)])
        self.stats.steps += 1
        self.stats.stacked_steps += 1
        self.stats.stacked_requests += len(group)
        return []

    def _stacked(self, runs: list[RequestRun]) -> list[tuple[dict, object]]:
        """One planned step for the pending RowsCalls of `runs` (module docstring): each run's
        (outputs, its rows' NaN flag: a 0-d device tensor or None), in order (not yet sent to
        the runs). Nothing here reads the device: pads and counts come from host-known shapes."""
        cfg, dtype = self.engine.model.cfg, self.engine.model.dtype
        calls = [r.pending for r in runs]
        if isinstance(calls[0], BlockCall):
            return self._stacked_diffusion(runs, calls)
        if calls[0].cache is not None:
            return self._stacked_blocks(runs, calls)
        L = max(c.ids.shape[1] for c in calls)
        ids, valid, pos, rows, counts, pads = [], [], [], [], [], []
        off = 0
        for run, call in zip(runs, calls):
            Bi, Li = call.ids.shape
            p = L - Li
            vr, own_pads = _own_padding(run, call)
            v = vr if vr is not None else torch.ones(Bi, Li, dtype=torch.bool, device=call.ids.device)
            own = make_step(cfg, call.ids, vr, dtype=dtype, row_pads=own_pads).positions   # the run's own positions
            fill = torch.zeros(Bi, p, dtype=call.ids.dtype, device=call.ids.device)
            ids.append(torch.cat([fill, call.ids], 1))
            valid.append(torch.cat([torch.zeros(Bi, p, dtype=torch.bool, device=v.device), v], 1))
            pos.append(torch.cat([torch.zeros(Bi, p, dtype=own.dtype, device=own.device), own], 1))
            r = call.rows
            rows.append((off + r // Li) * L + r % Li + p)
            counts.append(int(r.shape[0]))
            pads = None if pads is None or own_pads is None else pads + [p + q for q in own_pads]
            off += Bi
        ids, valid, pos, rows = torch.cat(ids), torch.cat(valid), torch.cat(pos), torch.cat(rows)
        reducer = StackedReducer([c.reducer for c in calls], counts)
        outs = self.engine.executor.stacked(ids, valid, pos, rows, reducer, runs[0].state.offload,
                                            None if pads is None else tuple(pads), interrupt=_all_cancelled(runs))
        self.stats.rows += int(ids.numel())
        # pads known on the host (a self-speculative canvas's are not: counted from valid, read)
        self.stats.pad_rows += sum(pads) if pads is not None else int((~valid).sum())
        return _split(outs, counts)

    def _stacked_blocks(self, runs: list[RequestRun], calls) -> list[tuple[dict, object]]:
        """One block step of several requests' block caches (models/stacked_cache.py)."""
        parts, rows, offs, counts, pads, off = [], [], [], [], [], 0
        n = calls[0].cache.hi - calls[0].cache.lo
        for run, call in zip(runs, calls):
            parts.append((call.ids, run.state.valid, call.cache.lo, call.cache.hi, run.state.store))
            pads.append(run.state.pads)
            rows.append(call.rows)
            offs.append(off * n)                      # rows index each request's B_i x n block rows
            counts.append(int(call.rows.shape[0]))
            off += call.ids.shape[0]
        reducer = StackedReducer([c.reducer for c in calls], counts)
        outs = self.engine.executor.stacked_blocks(parts, _stack_rows(rows, offs, counts), reducer,
                                                   runs[0].state.offload, pads, interrupt=_all_cancelled(runs))
        self.stats.rows += off * n
        return _split(outs, counts)

    def _stacked_diffusion(self, runs: list[RequestRun], calls) -> list[tuple[dict, object]]:
        """One step of several block-diffusion requests' block steps (models/block_cache.py)."""
        parts, rows, offs, counts, off = [], [], [], [], 0
        n = calls[0].hi - calls[0].a
        for run, call in zip(runs, calls):
            c = run.canvas
            parts.append((c.ids, tuple(c.pads), call.a, call.hi, run.state.store))
            rows.append(call.rows)
            offs.append(off * n)                      # rows index each request's B_i x n block rows
            counts.append(int(call.rows.shape[0]))
            off += c.batch
        reducer = StackedReducer([c.reducer for c in calls], counts)
        rows = _stack_rows(rows, offs, counts)
        outs = self.engine.executor.stacked_block_diffusion(parts, runs[0].canvas.block, rows, reducer,
                                                            interrupt=_all_cancelled(runs))
        self.stats.rows += off * n
        return _split(outs, counts)


def _own_padding(run: RequestRun, call) -> tuple:
    """(valid [B_i, L_i] or None, each canvas row's left padding as host ints, or None where the
    host does not know it) of a run's plain call: its state's; for several canvases of one row
    (self-speculative: canvas_rows on the device), that row's valid, read by make_step."""
    vr, pads = run.state.valid, run.state.pads
    if vr is None:
        return None, (0,) * call.ids.shape[0]
    if call.canvas_rows is None:
        return vr, pads
    return vr[call.canvas_rows], None


def _all_cancelled(runs: list[RequestRun]):      # a stacked step's interrupt(): no run loses a step
    return lambda: all(r.is_cancelled() for r in runs)


def _split(outs: dict, counts: list[int]) -> list[tuple[dict, object]]:
    """A stacked step's outputs cut into each request's rows [o_i, o_i + c_i), with its NaN flag
    (the 0-d view of output "nan" [S] at i: engine/steps.Executor.execute; None without one).
    One split and one unbind: views, the same for any number of requests."""
    nan = outs.pop("nan", None)
    flags = nan.unbind() if nan is not None else [None] * len(counts)
    parts = {k: v.split(counts) for k, v in outs.items()}
    return [({k: p[i] for k, p in parts.items()}, flag) for i, flag in enumerate(flags)]


def _stack_rows(rows: list, offs: list[int], counts: list[int]) -> torch.Tensor:
    """[M] the requests' rows (each flat over its own B_i x n rows) renumbered into the stacked
    step's: rows_i + offs_i, as one add of a cached offset per row (not an add per request)."""
    flat = torch.cat(rows)
    if not any(offs):
        return flat
    return flat + repeated_on(tuple(offs), tuple(counts), flat.device)


def _outcome(fn):
    """fn()'s value, or the Exception it raised (the run's error, reported with it)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return e
