"""The one prepare: chunk counts, template, plan and bytes needed for a step.

Admission, execution, the capacity planner and the memory plot all call `Preparer.prepare`, so
what is admitted is exactly what runs: choose chunks (lazy search or fixed) -> record -> plan ->
plan bytes + the largest out-of-plan allocation."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..models.step import Step
from ..runtime.runner import Prepared
from ..runtime.templates import TemplateCache
from .chunking import LazyChunker


@dataclass(frozen=True)
class StepStats:
    """One prepared step, for reports: its key, chunk counts, bytes and preparation time (ms)."""
    key: tuple
    chunks: tuple[int, int, int]
    plan_bytes: int
    load_bytes: int
    external_bytes: int
    fused: bool
    plan_ms: float
    record_ms: float
    cached: bool


class Preparer:
    """Prepares steps of one model: `chunk_policy(tc, step) -> Chunks` picks the counts.

    Masked counts fall during a request, so the plan made for the largest count seen with the
    same shape serves every later step (its buffers are views of at most the planned size); a
    larger count re-plans. `history` keeps a StepStats per prepare, the last `history_keep` of
    them (a process serving for days stays flat: 600 calls of 4 steps held 2,400 entries)."""

    def __init__(self, templates: TemplateCache, chunk_policy=None, history_keep: int = 4096):
        self.tc = templates
        self.chunk_policy = chunk_policy or LazyChunker(lambda step: None)
        self.caps: dict = {}
        self.history: list[StepStats] = []
        self.history_keep = history_keep

    def capped(self, step: Step, remember: bool = True) -> Step:
        """The step to plan for: its masked count (and, sharded, the count over all ranks)
        raised to the largest seen for its shape."""
        base = self.tc.base_key(step)
        total = step.masked_total or 0
        seen = self.caps.get(base, (0, 0))
        cap = (max(seen[0], step.num_masked), max(seen[1], total))
        if remember:
            self.caps[base] = cap
        if cap == (step.num_masked, total):
            return step
        meta = torch.empty(cap[0], dtype=torch.long, device="meta")
        return step.with_(rows=meta, rows_uncond=None if step.rows_uncond is None else meta,
                          masked_total=cap[1] or None)

    def prepare(self, step: Step, remember: bool = True) -> Prepared:
        """Everything but running `step`. remember=False (admission, capacity, plots) leaves the
        masked-count caps and the history untouched.

        Raises MemoryBudgetError (from the lazy search) when no chunking fits the budget."""
        t0 = time.perf_counter()
        planned = self.capped(step, remember)
        chunks = self.chunk_policy(self.tc, lead_step(planned))
        tpl, rec_ms, cached = self.tc.template(planned, chunks)
        key = self.tc.key(planned, chunks)
        plan = self.tc.plan(tpl, key)
        ms = (time.perf_counter() - t0) * 1e3
        prepared = Prepared(planned.with_(chunks=chunks), chunks, tpl, plan, key, self.tc.fused(planned),
                            rec_ms, ms, cached)
        if remember:
            self.history.append(StepStats(key, chunks.as_tuple(), plan.total_bytes, plan.load_bytes,
                                          tpl.external_peak(), prepared.fused, ms, rec_ms, cached))
            if len(self.history) > self.history_keep:
                del self.history[:-self.history_keep]
        return prepared


def lead_step(step: Step) -> Step:
    """The step whose chunk counts every rank uses under sequence parallelism: the largest rank's
    shard with the most masked rows any rank can hold, min(masked over all ranks, B x its rows).
    Each attention chunk is a round of broadcasts, so all ranks must run the same counts; this
    step is the same on every rank and no rank's own step is larger. Unsharded: the step itself."""
    sh = step.shard
    if sh is None:
        return step
    cond = step.batch // (2 if step.rows_uncond is not None else 1)   # cfg runs the batch twice
    m = max(1, min(step.masked_total or step.num_masked, cond * sh.max_rows))
    meta = torch.empty(m, dtype=torch.long, device="meta")
    return step.with_(shard=sh.lead(), rows=meta, rows_uncond=None if step.rows_uncond is None else meta,
                      masked_total=step.masked_total or step.num_masked)

