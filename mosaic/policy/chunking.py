"""Lazy chunking: split only the phase that holds the peak, only as far as needed.

A phase's peak (bytes live in the plan + bytes allocated outside it, at its worst op) is affine
in the rows per chunk r once r is past the scratch tile (4096 rows): P(r) = A + B*r. Two cheap
recordings (1 and 2 chunks) give A and B; solving P(r) <= limit gives a count, which is then
checked on the exact template and nudged up or down by one until it is the smallest that fits.
Phases are independent: each one's buffers are dead before the next phase starts, only the
residual stream and the step's outputs are common to all.

Every function here takes `tc`, a runtime.templates.TemplateCache (record + plan per key)."""

from __future__ import annotations

import dataclasses
import math

from ..errors import MemoryBudgetError, gib
from ..models.block_cache import BlockCacheStep
from ..models.step import Chunks
from .op_work import op_chunks

PHASES = ("attn", "ffn", "logits")
# Query rows per attention chunk even when memory is plentiful: SDPA's output lives outside the
# plan (8 KiB per row for LLaDA-8B), so unbounded chunks would put the unplanned share of the
# step at q_dim/(4*F) ~ 12% of it; 16,384-row chunks keep it to 128 MiB and cost nothing
# measurable (each chunk is still a large SDPA call).
ATTN_ROWS = 16384
# Under sequence parallelism the attention runs one small round (a broadcast, a partial
# attention, a merge: ~0.1 ms of host work on a GPU) per (query chunk, K/V piece) pair, pieces
# are no longer than query chunks, and every query chunk re-streams the peers' K/V. So query
# chunks are at most RING_CHUNKS per layer: the pairs stay under RING_CHUNKS^2 x W per layer
# (~3 s of host work per layer at L_max on 2 GPUs), and chunks of rows / 128 keep the copy
# behind the math (it hides once a chunk has more than ~700 rows on two H200s). The price is in
# the floor: a chunk's q, fp32 accumulator, kernel output and two receive slots, 64 KiB per row
# for LLaDA-8B, i.e. rows / 128 x 64 KiB = 2% of the x + K + V floor (24 KiB per row); LLaDA-8B
# on 2 GPUs holds 1.949x one GPU's L_max at 20 GiB and 1.956x at 40 GiB (before NCCL's own
# bytes; 192 would give 1.966x at 1.9x the host work). A constant cap (not one in rows) keeps
# "fits" monotone in the length, so capacity and admission's binary searches agree.
RING_CHUNKS = 128


def local_rows(step) -> int:
    """Positions per sequence this step computes: its shard's rows, or the whole length."""
    return step.shard.rows if step.shard is not None else int(step.ids.shape[1])


def base_chunks(step) -> Chunks:
    if step.offload is not None and step.offload.kv:
        # streamed K/V: no SDPA output outside the plan, and every query chunk reads all of K
        # and V over PCIe again, so the fewest (largest) query chunks that fit are the fastest
        return Chunks(1, 1, 1)
    return Chunks(max(1, math.ceil(local_rows(step) / ATTN_ROWS)), 1, 1)


def attention_floor(step, min_attention_rows: int = 0) -> int:
    """Query rows per attention chunk at least: min_attention_rows, raised to the streamed-K/V
    speed floor when the step streams (policy/offload.py: every query chunk re-reads K and V)."""
    if step.offload is not None:
        return max(min_attention_rows, step.offload.min_query_rows)
    return min_attention_rows


def max_count(step, phase: str, max_chunks: int, min_attention_rows: int = 0) -> int:
    """The most chunks a phase may be split into: one row each, max_chunks at most, under
    sequence parallelism RING_CHUNKS query chunks at most, and for attention at least
    min_attention_rows query rows per chunk (small query chunks leave SMs idle and multiply
    per-chunk work: a speed floor that costs a little capacity; streamed K/V raises it, see
    attention_floor)."""
    top = min(max_chunks, phase_rows(step, phase))
    if phase == "attn" and step.shard is not None:
        top = min(top, RING_CHUNKS)
    rows = attention_floor(step, min_attention_rows) if phase == "attn" else 0
    if rows > 0:
        top = min(top, max(1, phase_rows(step, phase) // rows))
    return top


def _with(chunks: Chunks, phase: str, count: int) -> Chunks:
    d = dict(zip(PHASES, chunks.as_tuple(), strict=True))
    d[phase] = count
    return Chunks(d["attn"], d["ffn"], d["logits"])


def phase_rows(step, phase: str) -> int:
    """The units a phase's chunks are cut from: attention query rows (whole blocks of a block
    step: models/block_cache.block_bounds never splits one, so a one-block step has one chunk
    however many are asked for), FFN rows, masked logits rows."""
    B, L = step.batch, local_rows(step)
    if phase == "attn" and isinstance(step.cache, BlockCacheStep):
        return max(1, L // step.cache.block)
    return {"attn": L, "ffn": B * L, "logits": max(int(step.rows.shape[0]), 1)}[phase]


def phase_peak(tc, step, phase: str, count: int) -> int:
    tpl, _, _ = tc.template(step, _with(Chunks(), phase, count))
    return tpl.phase_peaks().get(phase, 0)


def min_count(tc, step, phase: str, limit: int, max_chunks: int) -> int | None:
    """Smallest chunk count whose phase peak fits `limit`; None when even max_chunks does not."""
    n = phase_rows(step, phase)
    top = max_count(step, phase, max_chunks)
    p1 = phase_peak(tc, step, phase, 1)
    if p1 <= limit:
        return 1
    c2 = min(2, top)
    p2 = phase_peak(tc, step, phase, c2)
    r1, r2 = n, math.ceil(n / c2)
    slope = (p1 - p2) / max(r1 - r2, 1)
    if slope <= 0:
        return None
    base = p1 - slope * r1
    r_fit = (limit - base) / slope
    c = top if r_fit < 1 else min(top, max(c2, math.ceil(n / math.floor(r_fit))))
    # exact checks around the estimate: up until it fits, then down while it still fits
    while phase_peak(tc, step, phase, c) > limit:
        if c >= top:
            return None
        c = min(top, max(c + 1, math.ceil(c * 1.05)))
    while c > 1 and phase_peak(tc, step, phase, c - 1) <= limit:
        c -= 1
    return c


class LazyChunker:
    """Chooses chunk counts per step key under `limit(step)` activation bytes (None: no budget,
    only the 16k-row attention floor), and with op_flops (a CPU: policy/op_work.py) at least the
    counts that keep each op's work under it."""

    def __init__(self, limit, max_chunks: int = 4096, min_attention_rows: int = 0, op_flops: float | None = None):
        self.limit, self.max_chunks, self.min_attention_rows = limit, max_chunks, min_attention_rows
        self.op_flops = op_flops
        self.cache: dict = {}

    def __call__(self, tc, step) -> Chunks:
        limit = self.limit(step)
        least = op_chunks(step, tc.model.cfg, self.op_flops, self.max_chunks)
        if limit is None:
            return Chunks(*map(max, base_chunks(step), least))
        key = (tc.base_key(step), step.num_masked, limit)
        if key not in self.cache:
            self.cache[key] = choose(tc, step, limit, self.max_chunks,
                                     min_attention_rows=self.min_attention_rows, least=least)
        return self.cache[key]


class FixedChunks:
    """The same chunk counts for every step (EngineConfig.chunks); admission checks they fit."""

    def __init__(self, chunks: Chunks):
        self.chunks = chunks

    def __call__(self, tc, step) -> Chunks:
        return self.chunks


def choose(tc, step, limit: int, max_chunks: int, phases=PHASES, min_attention_rows: int = 0,
           least: Chunks = Chunks()) -> Chunks:
    """Minimal chunk counts for `phases` (the others stay unchunked) under `limit` bytes, with
    at least `min_attention_rows` query rows per attention chunk (0: no floor) and at least the
    counts `least` (a CPU's bounded ops). Raises MemoryBudgetError (phase: the phase that cannot
    fit, or "plan") when no counts fit."""
    tops = {p: max_count(step, p, max_chunks, min_attention_rows) if p in phases else 1 for p in PHASES}
    floor = dict(zip(PHASES, map(max, base_chunks(step), least), strict=True))
    counts = {}
    for phase in PHASES:
        c = min_count(tc, step, phase, limit, tops[phase])
        if c is None:
            best = phase_peak(tc, step, phase, tops[phase])
            floor_rows = attention_floor(step, min_attention_rows)
            rows = f", at least {floor_rows:,} query rows each" if phase == "attn" and floor_rows else ""
            raise MemoryBudgetError(
                f"the {phase} phase needs {gib(best)} even split into the most chunks "
                f"({tops[phase]}{rows}); {gib(limit)} is left for activations", needed_bytes=best,
                budget_bytes=limit, phase=phase)
        counts[phase] = max(c, floor[phase] if phase in phases else 1)
    return _grow_to_fit(tc, step, Chunks(counts["attn"], counts["ffn"], counts["logits"]), limit, tops)


def step_need(tc, step, chunks: Chunks) -> tuple[int, object]:
    """(bytes a step needs with these counts: its plan + the out-of-plan peak, its template).
    A sharded step (the lead rank's: every rank runs its counts) needs the most of the lead's
    and the last rank's plan: the last rank holds a row less, and the planner's packing is not
    monotone in rows (3 ranks of 8,192 tokens, 2 attention chunks: 2.73 MB on the last rank,
    2.56 MB on the lead), so counts that fit the lead alone failed admission on the last rank."""
    tpl, _, _ = tc.template(step, chunks)
    need = tc.plan(tpl, tc.key(step, chunks)).total_bytes + tpl.external_peak()
    sh = step.shard
    if sh is not None and sh.world > 1 and sh.bounds[-1][1] - sh.bounds[-1][0] != sh.max_rows:
        last = step.with_(shard=dataclasses.replace(sh, rank=sh.world - 1))
        ltpl, _, _ = tc.template(last, chunks)
        need = max(need, tc.plan(ltpl, tc.key(last, chunks)).total_bytes + ltpl.external_peak())
    return need, tpl


def growth_order(tpl) -> list[str]:
    """Phases to split further when the phases fit one by one but the step does not: the one at
    the plan's peak, then the one holding the out-of-plan peak (the transient pool is reserved
    for the whole step, so a sampling reducer's logits transient adds to an attention peak:
    LLaDA2's one-block steps, whose attention cannot split, fit only by more logits chunks),
    then the rest."""
    first = [tpl.phases[tpl.peak_op()] if tpl.phases else None]
    if tpl.external and max(tpl.external) > 0:
        first.append(tpl.phases[max(range(len(tpl.external)), key=tpl.external.__getitem__)])
    return list(dict.fromkeys([p for p in first if p in PHASES] + list(PHASES)))


def _grow_to_fit(tc, step, chunks: Chunks, limit: int, tops: dict) -> Chunks:
    """The planner may land above LOAD and the peaks of two phases add up: grow, one phase at a
    time, the first phase (growth_order) whose growth lowers the need, by half at a time
    until the step fits, then take each grown phase back down to the smallest count that still
    fits (bisection: a sixteenth at a time all the way took ~90 recordings per step at L_max)."""
    start, (need, tpl) = chunks, step_need(tc, step, chunks)
    last: list[str] = []        # the phase whose growth helped last time is tried first
    for _ in range(256):
        if need <= limit:
            return _tighten(tc, step, start, chunks, limit)
        for phase in dict.fromkeys(last + growth_order(tpl)):
            grown = _lower(tc, step, chunks, phase, tops[phase], need)
            if grown is not None:
                chunks, (need, tpl), last = grown, step_need(tc, step, grown), [phase]
                break
        else:
            break
    raise MemoryBudgetError(f"the plan needs {gib(need)} with chunks {chunks.as_tuple()}; "
                            f"{gib(limit)} is left for activations",
                            needed_bytes=need, budget_bytes=limit, phase="plan")


GROWTH_TRIES = 8   # counts tried per phase before another phase's growth is tried


def _lower(tc, step, chunks: Chunks, phase: str, top: int, need: int) -> Chunks | None:
    """The first count of `phase` above its current one (growing by half at a time: counts
    whose largest chunk has as many rows as now change nothing) whose step needs less than
    `need`, among the next GROWTH_TRIES counts (a phase whose growth does not lower the step's
    need gives up quickly); None when none does."""
    cur = dict(zip(PHASES, chunks.as_tuple(), strict=True))[phase]
    for _ in range(GROWTH_TRIES):
        if cur >= top:
            break
        cur = min(top, cur + max(1, cur // 2))
        grown = _with(chunks, phase, cur)
        if step_need(tc, step, grown)[0] < need:
            return grown
    return None


def _tighten(tc, step, start: Chunks, chunks: Chunks, limit: int) -> Chunks:
    """`chunks` (which fit) with each phase grown from `start` bisected down to the smallest
    count that still fits, the others as they are."""
    for k, phase in enumerate(PHASES):
        lo, hi = start[k], chunks[k]          # the count at lo did not fit (or was not tried), hi fits
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if step_need(tc, step, _with(chunks, phase, mid))[0] <= limit:
                hi = mid
            else:
                lo = mid
        chunks = _with(chunks, phase, hi)
    return chunks


def chunk_policy(fixed: tuple[int, int, int] | None, limit, max_chunks: int = 4096,
                 min_attention_rows: int = 0, op_flops: float | None = None):
    """FixedChunks when counts are given, else the lazy search under `limit(step)` (op_flops:
    a bound on each op's work, policy/op_work.py)."""
    if fixed is not None:
        return FixedChunks(Chunks(*fixed))
    return LazyChunker(limit, max_chunks, min_attention_rows, op_flops)
