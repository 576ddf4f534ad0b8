"""Capacity planning without running: templates of a model (meta weights) and their plans,
and L_max, the longest request that fits a budget."""

from __future__ import annotations

import time

import torch

from ..config import EngineConfig, GenerationConfig, parse_bytes
from ..errors import InputError, MemoryBudgetError, gib
from ..graph.shard import PEER_ROWS, Shard
from ..memory.accounting import FIXED_BYTES, INPUT_BYTES_PER_TOKEN, Budget, floor_bytes_per_token
from ..memory.kv_store import StoreLayout
from ..memory.planner import PLANNERS, align, plan
from ..models.kv_cache import CacheStep
from ..models.step import Chunks
from ..runtime.samplers import sampler_for
from ..runtime.templates import TemplateCache
from .admission import fit, resident_bytes
from .admitter import GRID, Admitter, split
from .block_admission import request_probe
from .chunking import choose, chunk_policy
from .features import check_plan
from .offload import mode_of
from .prepare import Preparer
from .probe import probe_step


def templates_for(model, planner="greedy-size", target="cuda", logits_kernel="auto") -> TemplateCache:
    """A template cache that records for `target` (a CPU plans for a GPU's kernel choices)."""
    return TemplateCache(model, planner, logits_kernel, record_device=torch.device(target))


def plan_report(model, n_tokens: int, n_masked: int, planners=PLANNERS[:4],
                chunks: Chunks = Chunks(), target: str = "cuda") -> dict:
    """Every planner's total and time on one template, with LOAD (the lower bound)."""
    tc = templates_for(model, target=target)
    step = probe_step(model, n_tokens, n_masked)
    tpl, rec_ms, _ = tc.template(step, chunks)
    sizes = [align(b.nbytes) for b in tpl.buffers]
    starts, ends = [b.start for b in tpl.buffers], [b.end for b in tpl.buffers]
    rows = []
    for name in planners:
        p = plan(sizes, starts, ends, name)
        rows.append({"planner": name, "plan_bytes": p.total_bytes, "load_bytes": p.load_bytes,
                     "over_load": p.over_load, "plan_ms": p.plan_ms, "optimal": p.optimal})
    return {"model": model.name, "tokens": n_tokens, "masked": n_masked,
            "chunks": list(chunks.as_tuple()), "num_buffers": len(tpl.buffers),
            "num_ops": tpl.num_ops, "record_ms": rec_ms, "external_bytes": tpl.external_peak(),
            "peak_op": tpl.op_names[tpl.peak_op()], "planners": rows}


KV_TIERS = ("device", "host")   # a block cache's K/V all on the device, or all on the host (two slots)


def kv_layout(model, n_tokens: int, tier: str, batch: int = 1, itemsize: int = 2) -> StoreLayout:
    """The block-cache store of a request of n_tokens under `tier` (device | host)."""
    return StoreLayout.of(model.cfg, batch, n_tokens, itemsize, None if tier == "device" else 0)


def cached_probe(model, step, tier: str | None):
    """(step, resident bytes): the probe step as a block cache's fill step charged its store."""
    if tier is None:
        return step, 0
    resident = kv_layout(model, step.length, tier, step.batch).device_bytes
    return step.with_(cache=CacheStep("fill", 0, step.length, step.length, None, resident)), resident


def capacity_preparer(model, budget: Budget, planner: str = "greedy-size", target: str = "cuda",
                      max_chunks: int = 4096, phases=None, logits_kernel: str = "auto",
                      min_attention_rows: int = 0) -> Preparer:
    """The Preparer the engine builds (templates for `target`, the lazy chunk search under the
    budget's activation limit less a block cache's store), so that capacity and admission run
    one code path. phases: the phases the search may split (default all)."""
    tc = templates_for(model, planner, target, logits_kernel)

    def limit(step):
        free = budget.activation_limit(step.batch, step.length, step.shard_slots)
        return None if free is None else free - resident_bytes(step)
    if phases is None:
        policy = chunk_policy(None, limit, max_chunks, min_attention_rows)
    else:
        policy = lambda tc_, step: choose(tc_, step, limit(step), max_chunks, phases,  # noqa: E731
                                          min_attention_rows=min_attention_rows)
    return Preparer(tc, policy)


def fits(preparer: Preparer, budget: Budget, model, n_tokens: int, n_masked: int, gen=None,
         batch: int = 1, world: int = 1, kv_tier: str | None = None, offload=None, sparse=None,
         prompt_ratio: float = 0.5):
    """(True, rank 0's Prepared) if every rank's share of the probe step fits (admission.fit,
    as run-time admission on each rank), else (False, the MemoryBudgetError). Ranks with equal
    rows plan alike: the first (largest share) and the last rank cover both row counts. kv_tier
    (device | host): the step is a Fast-dLLM fill step and its K/V store is charged on top.
    offload: the step's graph.streams.Offload (weights, and with kv K/V, streamed from host
    memory), None for resident weights. sparse: a SparseConfig whose block-sparse steps (after the
    dense ones) must fit too, as run-time admission checks them."""
    first = None
    if model.cfg.block_causal:   # block diffusion: its largest step and its block K/V store (policy/block_admission.py)
        P = round(prompt_ratio * n_tokens)
        step = request_probe(model, batch, P, n_tokens - P, gen or GenerationConfig(),
                             hot=0 if kv_tier == "host" else None, itemsize=model.dtype.itemsize)
        try:
            return True, fit(preparer, budget, step)
        except MemoryBudgetError as e:
            return False, e
    variants = (lambda st: st.with_(sparse=sparse),) if sparse is not None else ()
    for rank in sorted({0, world - 1}):
        step = probe_step(model, n_tokens, max(1, n_masked), gen, batch=batch, world=world,
                          rank=rank).with_(offload=offload)
        step, _ = cached_probe(model, step, kv_tier)
        try:
            prepared = fit(preparer, budget, step, variants)
        except MemoryBudgetError as e:
            return False, e
        first = first or prepared
    return True, first


def plan_admitter(model, preparer: Preparer, budget: Budget, world: int = 1, kv_tier: str | None = None,
                  offload=None, sparse=None, ratios=None) -> Admitter:
    """The Admitter `mosaic plan` asks: run-time admission's, for `world` sequence-parallel ranks
    emulated in this process (the largest and the last rank's shares are checked), one offload
    mode (its budget `budget`), a block cache's store under kv_tier (device | host) and the
    engine's block-sparse ranges."""
    # a block-diffusion model always keeps a store: on the device unless the host tier is asked for
    default_tier = "device" if model.cfg.block_causal else "auto"
    config = EngineConfig(sparse=sparse, kv_tier=kv_tier or default_tier, device="meta")

    def shards(n):
        return [None] if world == 1 else [Shard.of(n, r, world, piece_rows=PEER_ROWS) for r in sorted({0, world - 1})]
    adm = Admitter(model, config, preparer, lambda off: budget, lambda g: sampler_for(model.cfg, g),
                   shards=shards, world=world)
    if ratios is not None:
        adm.ratios = tuple(ratios)
    return adm


def _check_plan(model, kv_tier, world: int, offload, sparse) -> str | None:
    """The kv_tier to plan with, or InputError for a combination `mosaic plan` refuses."""
    if model.cfg.block_causal and kv_tier is None:
        kv_tier = "device"   # block diffusion always keeps its block K/V store
    if model.cfg.block_causal and (world > 1 or offload is not None or sparse is not None):
        raise InputError(f"{model.name} (block diffusion) is planned for one GPU with resident weights and dense "
                         "attention only")
    if kv_tier is not None and kv_tier not in KV_TIERS:
        raise InputError(f"kv_tier {kv_tier!r} is not one of {KV_TIERS}")
    check_plan(kv_tier, world, offload)
    return kv_tier


def _plan_budget(model, budget, offload, context_bytes, workspace_bytes, target: str):
    """(budget bytes, weight bytes charged, Budget) as the engine charges on `target`, or
    MemoryBudgetError when the weights and fixed charges alone exceed the budget."""
    budget_bytes = parse_bytes(budget)
    weights = model.weight_bytes(layers=offload is None)
    ctx = None if context_bytes is None else parse_bytes(context_bytes)
    ws = None if workspace_bytes is None else parse_bytes(workspace_bytes)
    if target == "cuda":   # what the engine charges on the H200 (measured context and workspace)
        bud = Budget.h200(budget_bytes, weights, ctx, ws)
    else:                  # what the engine charges on this device type (no allocator rounding)
        bud = Budget.build(budget_bytes, weights, ctx or 0, FIXED_BYTES if ws is None else ws, cuda=False)
    fixed = bud.fixed_bytes
    if budget_bytes is None or budget_bytes <= fixed:
        raise MemoryBudgetError(
            f"{model.name} at {gib(budget_bytes or 0)}: the weights alone need {gib(weights)}, plus "
            f"{gib(fixed - weights)} of context and workspace, before any token; a budget above "
            f"{gib(fixed)} is needed", needed_bytes=fixed, budget_bytes=budget_bytes or 0, max_tokens=0)
    return budget_bytes, weights, bud


def _floor(model, kv_tier, offload) -> tuple[int, int]:
    """(floor bytes per token, a block cache's device bytes per token) of the physical limit."""
    # with a block cache the fill step writes K and V into the store: the floor is x alone
    floor = floor_bytes_per_token(model.cfg) if kv_tier is None else 2 * model.cfg.hidden
    if offload is not None and offload.kv:   # K and V live in host memory: x is the floor
        floor = model.dtype.itemsize * model.cfg.hidden
    if model.cfg.block_causal:   # a step runs one block past the prompt: the store is the floor
        floor = 0
    kv_item = model.dtype.itemsize if model.cfg.block_causal else 2   # block stores: as request_probe charges
    # per token: a device-tier store counts whole pages of tokens, the bound counts one token
    kv_per_token = 0 if kv_tier is None else kv_layout(model, 1, kv_tier, itemsize=kv_item).with_page(1).device_bytes
    return floor, kv_per_token


def _row(bud, ratio: float, masked: int, res) -> dict:
    """One mask ratio's row of the report at L_max."""
    p, tpl = res.plan, res.template
    resident = resident_bytes(res.step)
    return {"mask_ratio": ratio, "masked": masked, "chunks": list(res.chunks.as_tuple()),
            "plan_bytes": p.total_bytes, "external_bytes": tpl.external_peak(),
            "predicted_peak_bytes": bud.total(p.total_bytes + tpl.external_peak() + resident, 1,
                                              res.step.length, res.step.shard_slots),
            "host_bytes": tpl.host_bytes, "peak_phase": tpl.phases[tpl.peak_op()]}


def _limiting(probe, nxt: int, ratios) -> str | None:
    """Which phase stops the next length (None: it fits)."""
    for r in ratios:
        good, res = probe(nxt, r)
        if not good:
            return str(res).split(" phase")[0].replace("the ", "") if "phase" in str(res) else "plan"
    return None


def capacity_report(model, budget, prompt_ratio: float = 0.5, planner: str = "greedy-size",
                    context_bytes=None, ratios=(1.0, 0.1), max_chunks: int = 4096,
                    target: str = "cuda", phases=None, world: int = 1, kv_tier: str | None = None,
                    min_attention_rows: int = 0, workspace_bytes=None, offload=None, sparse=None) -> dict:
    """L_max at a budget (per GPU): the longest N (a multiple of 1024) whose capacity probe (one
    step at each mask ratio of the output canvas) fits, with lazy chunking (attention chunks of
    at least min_attention_rows query rows when > 0), on every one of `world` sequence-parallel
    ranks. CPU-only: templates are recorded on meta tensors. The test is admission.fit on the
    engine's Preparer: with the same context bytes, target device and dtype, run-time admission
    admits exactly this L_max and refuses L_max + 1024.

    Charged as run-time admission charges on the H200 (memory.accounting.Budget.h200): its
    measured context and workspace unless given (bytes or '600MiB'). kv_tier (device | host):
    with a Fast-dLLM block cache, whose K/V (every layer, every token) are charged on the device,
    or kept on the host behind two device staging slots. offload: a graph.streams.Offload (layer
    weights in host memory: only the non-layer weights are charged, the staging slots are in the
    plan; with kv, K and V too: the floor is x alone; docs/OFFLOAD.md). sparse: the engine's
    SparseConfig (block-sparse steps must fit too; their layouts and block scores are charged)."""
    kv_tier = _check_plan(model, kv_tier, world, offload, sparse)
    t0 = time.perf_counter()
    budget_bytes, weights, bud = _plan_budget(model, budget, offload, context_bytes, workspace_bytes, target)
    fixed, context = bud.fixed_bytes, bud.context_bytes
    prep = capacity_preparer(model, bud, planner, target, max_chunks, phases, min_attention_rows=min_attention_rows)
    admitter = plan_admitter(model, prep, bud, world=world, kv_tier=kv_tier, offload=offload, sparse=sparse,
                             ratios=ratios)
    gen = GenerationConfig(cache="dual") if kv_tier is not None else GenerationConfig()

    def masked(n, ratio):
        return max(1, round((1 - prompt_ratio) * n * ratio))

    def probe(n, ratio):
        return fits(prep, bud, model, n, masked(n, ratio), world=world, kv_tier=kv_tier, sparse=sparse,
                    offload=offload, prompt_ratio=prompt_ratio)

    floor, kv_per_token = _floor(model, kv_tier, offload)
    physical = world * max(0, (budget_bytes - fixed - bud.rounding_bytes)) // (floor + INPUT_BYTES_PER_TOKEN
                                                                               + kv_per_token)   # an upper bound
    l_max = admitter.longest(1, split(gen, 1 - prompt_ratio), physical + GRID, lo=max(GRID, world), unit=GRID,
                             offload=offload)
    if l_max == 0:  # the table would be empty: say what the shortest probe needs instead
        n = 1024
        err = probe(n, ratios[0])[1]
        need = bud.total(getattr(err, "needed_bytes", 0), 1, n)
        raise MemoryBudgetError(
            f"{model.name} at {gib(budget_bytes)}: not even {n:,} tokens fit (they need about {gib(need)}: "
            f"weights {gib(weights)}, context and workspace {gib(fixed - weights)}, activations "
            f"{gib(need - fixed)})", needed_bytes=need, budget_bytes=budget_bytes, max_tokens=0)
    rows = [_row(bud, r, masked(l_max, r), res) for r in (1.0, 0.5, 0.1) for good, res in [probe(l_max, r)] if good]
    limiting = _limiting(probe, l_max + 1024, ratios)
    return {"model": model.name, "world": world, "budget_bytes": budget_bytes, "weights_bytes": weights,
            "context_bytes": context, "fixed_bytes": bud.workspace_bytes,
            "workspace_bytes": bud.workspace_bytes, "late_load_bytes": bud.late_bytes,
            "rounding_bytes": bud.rounding_bytes, "charged_fixed_bytes": fixed, "prompt_ratio": prompt_ratio,
            "l_max": l_max, "physical_limit": int(physical), "floor_bytes_per_token": floor,
            "limiting_phase": limiting, "steps": rows, "planner": planner, "kv_tier": kv_tier,
            "kv_cache_bytes_per_token": kv_per_token, "min_attention_rows": min_attention_rows,
            "offload": mode_of(offload),
            "seconds": time.perf_counter() - t0}


def print_capacity(rep: dict) -> str:
    per = f" per GPU x {rep['world']}" if rep.get("world", 1) > 1 else ""
    kv = ""
    if rep.get("kv_tier"):
        kv = (f" with a block cache on the {rep['kv_tier']} "
              f"(+{rep['kv_cache_bytes_per_token']:,} B per token on the device)")
    lines = [f"{rep['model']} at {gib(rep['budget_bytes'])}{per}{kv}: L_max = {rep['l_max']:,} tokens "
             f"(physical limit {rep['physical_limit']:,} = (budget - weights - context - workspace "
             f"- allocator rounding) / {rep['floor_bytes_per_token'] + INPUT_BYTES_PER_TOKEN:,} B per "
             f"token); next length limited by "
             f"{rep['limiting_phase']}",
             f"{'mask ratio':>10} {'masked':>10} {'chunks a,f,l':>16} {'plan':>11} {'outside':>10} "
             f"{'predicted peak':>15} {'peak phase':>11}"]
    for r in rep["steps"]:
        lines.append(f"{r['mask_ratio']:>10} {r['masked']:>10,} {str(tuple(r['chunks'])):>16} "
                     f"{gib(r['plan_bytes']):>11} {gib(r['external_bytes']):>10} "
                     f"{gib(r['predicted_peak_bytes']):>15} {r['peak_phase']:>11}")
    lines.append(f"({rep['seconds']:.1f} s on this CPU, planner {rep['planner']}; charged as on the GPU: context "
                 f"{gib(rep['context_bytes'])}, workspace {gib(rep['workspace_bytes'])}; --context-bytes changes them)")
    return "\n".join(lines)
