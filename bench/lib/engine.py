"""Every access a suite makes to MosaicEngine beyond its public calls (MosaicEngine(...),
generate, close, memory_report, lossy_options, model), in one place: the engine is being split
into smaller objects, and these functions are what has to follow it. A suite never reads or
writes an engine attribute itself."""

from __future__ import annotations

import torch

from .measure import other_bytes


# -- one step, one forward
def step(engine, x: torch.Tensor, native: bool = False, config: dict | None = None, probe=None):
    """One denoising step of the family's sampler over every masked position of canvas x
    [batch, N]: the published forward + sampler (native) or Mosaic's planned path. Returns the
    step's (candidates, confidences)."""
    if config is None:
        return engine.step(x, native=native, probe=probe)
    return engine.step(x, native=native, config=config, probe=probe)


def step_fn(engine, x: torch.Tensor, native: bool = False, probe=None):
    """A zero-argument callable running step(engine, x, native)."""
    return lambda: step(engine, x, native=native, probe=probe)


def forward_logits(engine, ids: torch.Tensor) -> torch.Tensor:
    """Logits [batch, N, V] of one forward of ids."""
    return engine.forward_logits(ids)


def native_forward(engine):
    """The native runner's forward(ids, attention_mask) -> logits (the published model code)."""
    return engine.native_runner.forward


def wrap_planned_execute(engine, wrap):
    """Replace the planned runner's execute(step, prepared, ...) by wrap(real) (a profiler around
    one step); returns a function that puts the real one back."""
    runner = engine.runner
    real = runner.execute
    runner.execute = wrap(real)
    return lambda: setattr(runner, "execute", real)


def compile_native_forward(engine) -> None:
    """Replace the native runner's forward by torch.compile of it (the compiled baseline)."""
    engine.native_runner.forward = torch.compile(engine.native_runner.forward)


def set_attention(engine, kind: str) -> None:
    """The planned runner's attention kernel for the next steps ('sdpa', 'cudnn', ...)."""
    engine.runner.attention = kind


def execute(engine, step_obj):
    """Prepare (plan, chunks) and run a mosaic.models.step.Step on the planned runner (the
    engine's Executor: the NaN check and the captured-step path included)."""
    from mosaic.engine.steps import RowsState
    return engine.executor.execute(step_obj, RowsState())


def planned_predict(engine, gen, store, generator: torch.Generator):
    """The sampler's planned predict(x, lo, hi, candidates, cache_mode) for generation options gen
    with the K/V store `store` (Fast-dLLM's cached steps), run to its result: the predict is a
    coroutine yielding its forwards; the engine's Executor runs them."""
    from mosaic.engine.steps import RowsState
    from mosaic.runtime.samplers.base import drive
    predict = engine.sampler_for(gen).planned_predict(gen, generator)
    state = RowsState(store=store)
    return lambda *a, **k: drive(predict(*a, **k), lambda call: engine.executor(call, state))


def sampler_options(engine) -> set:
    """The generation options this engine's sampler family accepts."""
    return engine.sampler.options


# -- admission and the budget
def generation_config(engine, **overrides):
    """The engine's GenerationConfig with overrides (max_new_tokens, steps, ...)."""
    return engine.generation_config(None, **overrides)


def admit(engine, batch: int, length: int, gen):
    """Admission of a request of `batch` rows of `length` tokens: an Admission (predicted_bytes,
    chunks), or MemoryBudgetError (nothing allocated)."""
    return engine.admit(batch, length, gen)


def start(engine, prompt, progress: bool = False, **options):
    """A checked, admitted request's RequestRun, not started: MemoryBudgetError here is a
    refusal before anything is allocated; run.run() then gives the Generation."""
    return engine.start(engine.request(prompt, **options), progress=progress)


def store_hot_layers(admission) -> int | None:
    """How many layers' K/V an Admission keeps on the device (kv_tier auto), None without a store."""
    return admission.layout.hot if admission.layout is not None else None


def budget(engine):
    """The engine's Budget: budget_bytes, context_bytes, workspace_bytes, fixed_bytes."""
    return engine.budget


def config(engine):
    """The engine's EngineConfig."""
    return engine.config


def warmup_report(engine) -> dict:
    return engine.warmup_report or {}


def precision_report(engine) -> dict:
    return engine.precision_report or {}


def history(engine) -> list:
    """The prepared steps so far (each: chunks, plan_bytes, external_bytes, load_bytes, key)."""
    return engine.history


def last_chunks(engine) -> list | None:
    """Chunk counts of the last prepared step, or None before any step."""
    return list(engine.history[-1].chunks) if engine.history else None


def template(engine, key):
    """The cached step template of a history entry's key, or None."""
    return engine.templates.get(key)


# -- the device's memory as the engine holds it
def arena_kind(engine) -> str:
    return engine.arena.kind


def arena_mapped_bytes(engine) -> int:
    return engine.arena.mapped_bytes


def arena_peak_bytes(engine) -> int:
    """The arena's mapped peak (bytes outside PyTorch's allocator only for the vmm arena)."""
    return engine.arena.peak_bytes


def vmm_peak_bytes(engine) -> int:
    """The arena's peak pages outside PyTorch's counters: its peak for 'vmm', else 0."""
    return engine.arena.peak_bytes if engine.arena.kind == "vmm" else 0


def reset_arena_peak(engine) -> None:
    engine.arena.peak_bytes = engine.arena.mapped_bytes


def arena_extra_bytes(engine, now: bool = False) -> int:
    """Device bytes the arena holds outside PyTorch's counters (peak, or now)."""
    return engine.arena_extra_bytes(now=now)


def release(engine) -> bool:
    """Hand the guard's pool, the arena's pages and cached blocks back (False without a guard)."""
    if engine.guard is None:
        return False
    engine.guard.release(engine.arena)
    return True


def guard_limit_bytes(engine) -> int | None:
    return engine.guard.last_limit_bytes if engine.guard is not None else None


def host_kv_bytes(engine) -> int:
    return engine.runner.host_pool.nbytes


def clear_host_kv(engine) -> None:
    engine.runner.host_pool.clear()


def bytes_copied(engine) -> int:
    """Bytes the offload copier moved host -> device so far."""
    return engine.runner.copier.bytes_copied


def host_weight_bytes(engine) -> int:
    return engine.placement.host_bytes


def place_resident(engine) -> None:
    """Move offloaded layers back to the device (the next engine on this model finds them there)."""
    engine.placement.ensure(False)


def missing_weight_bytes(model) -> int:
    """Weight bytes a depth-truncated model is charged but does not hold (Model.charged_layers)."""
    from mosaic.engine.warmup import phantom_weight_bytes
    return phantom_weight_bytes(model)


def counters_peak(engine) -> int:
    """A step's device peak by the counters: CUDA context + PyTorch's peak reserved + the vmm
    arena's peak pages + the weights a truncated model is charged but does not hold, minus a
    parent process's usage (MOSAIC_BENCH_OTHER_BYTES)."""
    from mosaic.memory.accounting import context_bytes
    ctx = context_bytes(engine.model.device) - engine.arena_extra_bytes(now=True) - other_bytes()
    return ctx + torch.cuda.max_memory_reserved() + vmm_peak_bytes(engine) + missing_weight_bytes(engine.model)


def memory_plot(engine, prompts, gen, path: str) -> dict:
    """The measured (GPU) and planned memory series of a request's first step, drawn to path."""
    return engine.memory_plot(prompts, gen, path)


# -- captured steps (runtime/graphs.py)
def captured_steps(engine) -> list:
    """[(key, Captured)] of the engine's captured steps, oldest first: key = (template key, ids
    shape (B, n), arena address, where: a block cache's (mode, lo, hi, store address)); a
    Captured's .graph replays the step on the inputs last copied in. [] without graphs."""
    g = engine.graphs
    return [] if g is None else list(g.graphs.items())


def graph_stats(engine) -> dict | None:
    """Captures, replays, eager runs, capture ms, pool bytes and failures (None without graphs)."""
    return None if engine.graphs is None else engine.graphs.stats.as_dict()
