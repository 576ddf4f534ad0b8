"""The device-memory budget: what is charged, what is left for activations, admit or refuse.

Charged: CUDA context (measured on the device; 0.60 GiB measured on the H200 for planning on a
CPU), weights, a fixed workspace (cuBLAS, small tensors, allocator rounding), the step's input
index tensors, the arena's plan and whatever an op allocates outside the plan (SDPA's output,
the sampler's transients): everything the process holds on the device."""

from __future__ import annotations

import torch

from ..config import parse_bytes
from ..errors import MemoryBudgetError, gib

H200_CONTEXT_BYTES = int(0.60 * 2**30)  # BENCHMARKS.md: CUDA context on this project's H200
FIXED_BYTES = 320 * 2**20               # cuBLAS workspaces, RNG state, small tensors, rounding
# the canvas and the sampler's per-token tensors on the device during a step: ids, positions,
# row list, full-length candidate ids and confidences, masks (int64 mostly)
INPUT_BYTES_PER_TOKEN = 64


def card_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def context_bytes(device: torch.device) -> int:
    """What the process holds on the device outside PyTorch's allocator (context, handles)."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def input_bytes(batch: int, length: int) -> int:
    return INPUT_BYTES_PER_TOKEN * batch * length


def charged_fixed(weights: int, context: int) -> int:
    return weights + context + FIXED_BYTES


def budget_of(engine) -> int | None:
    return parse_bytes(engine.config.memory_budget, card_bytes(engine.model.device))


def activation_limit(engine, step) -> int:
    B, L = step.ids.shape
    return budget_of(engine) - engine.fixed_bytes - input_bytes(B, L)


def first_step(engine, batch: int, length: int, gen):
    """The request's first step on meta tensors: the most masked rows it will ever have."""
    from .capacity import probe_step
    cfg = engine.model.cfg
    dream = cfg.family == "dream"
    per_seq = gen.max_new_tokens if dream else (gen.block_length or gen.max_new_tokens)
    cfg_pair = not dream and gen.cfg_scale > 0
    step = probe_step(engine.model, length, per_seq * batch, gen, batch=batch * (2 if cfg_pair else 1))
    if cfg_pair:
        step.rows_uncond = step.rows
    from ..engine.parallel import current
    step.shard = current(length)   # under sequence parallelism each rank plans its own share
    return step


def admit(engine, shape, gen) -> None:
    """Refuse a request whose first step cannot fit, before anything is allocated for it."""
    budget = budget_of(engine)
    if budget is None:
        return
    B, L = shape
    runner = engine.planned
    step = first_step(engine, B, L, gen)
    try:
        planned = runner.capped(step)
        chunks = runner.chooser(runner, planned)
        tpl, _, _ = runner.template(planned, chunks)
        plan = runner.plan(tpl, runner.key(planned, chunks))
        need = plan.total_bytes + tpl.external_peak()
        limit = activation_limit(engine, step)
        if need > limit:  # fixed chunk counts are not searched: check them here
            raise MemoryBudgetError(f"chunks {chunks.as_tuple()} need {gib(need)}; {gib(limit)} is left "
                                    "for activations", needed_bytes=need, budget_bytes=limit)
    except MemoryBudgetError as e:
        from .capacity import longest_fitting
        longest = longest_fitting(engine, B, L, gen)
        need = e.needed_bytes + engine.fixed_bytes + input_bytes(B, L)
        raise MemoryBudgetError(
            f"request of {B} x {L:,} tokens needs at least {gib(need)}; budget is {gib(budget)} "
            f"(weights {gib(engine.model.weight_bytes())}, context and workspace "
            f"{gib(engine.fixed_bytes - engine.model.weight_bytes())}); longest that fits: "
            f"{longest:,} tokens", needed_bytes=need, budget_bytes=budget,
            max_tokens=longest) from None
    engine.last_prediction = plan.total_bytes + tpl.external_peak() + engine.fixed_bytes + \
        input_bytes(B, L)
