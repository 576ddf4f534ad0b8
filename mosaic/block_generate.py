"""The request loop of block-diffusion families (LLaDA2.x), behind one hook in
MosaicEngine.generate: canvas, admission with the block K/V store, the store, the steps.

Kept apart from the engine facade (which is being restructured) on purpose: it uses the
engine's preparer, budget, runner and request guard only through `_execute`, `_begin_request`
and `_end_request`, and builds the same Generation. The sampler owns the loop
(runtime/samplers/block_diffusion.py), models/block_cache.py the step program, policy/
block_admission.py the admission, memory/kv_store.py the store."""

from __future__ import annotations

import time

import torch

from .errors import InputError
from .graph.shard import world
from .memory.accounting import INPUT_BYTES_PER_TOKEN
from .memory.kv_store import KVStore
from .models.block_cache import BlockCacheStep, block_step
from .policy.block_admission import admit_blocks
from .prompts import pad_filler
from .runtime.block_canvas import block_canvas


def refuse_options(engine, native: bool) -> None:
    """InputError for engine options the block loop does not combine with (before any work)."""
    cfg = engine.config
    if native:
        raise InputError("the block-diffusion sampler runs on the planned path only (its block K/V cache is exact "
                         "by construction): drop native=True (--native)")
    if world()[1] > 1:
        raise InputError("block-diffusion models run on one process (no sequence parallelism yet): drop --gpus")
    if cfg.sparse is not None:
        raise InputError("block-sparse attention is not available for block-diffusion models (their attention is "
                         "already block-causal over a cache)")
    if cfg.offload not in ("off", None):
        raise InputError(f"offload {cfg.offload!r} is not available for block-diffusion models yet; their K/V live in "
                         "the block store (kv_tier: device, host or auto): use offload: off")


def generate(engine, sampler, prompts: list[list[int]], gen, *, native: bool = False, progress=None,
             on_step=None, probe=None, result_type=None):
    """One batch through the block loop; returns the engine's Generation (result_type).
    Raises InputError / MemoryBudgetError before any work for what cannot run or fit."""
    refuse_options(engine, native)
    model = engine.model
    cfg, dev = model.cfg, model.device
    pad = pad_filler(cfg)
    canvas = block_canvas(prompts, gen.max_new_tokens, sampler.block(gen), cfg.mask_id, pad, dev)
    B, W, bl = canvas.batch, canvas.width, canvas.block
    with engine.lock:
        adm, layout = admit_blocks(engine.preparer, engine.budget, model, canvas, gen, engine.config.kv_tier)
        engine.last_admission, engine.last_store_layout = adm, layout
    engine._begin_request(adm)
    store = KVStore(layout, dev, model.dtype)
    generator = None if gen.seed is None else torch.Generator(device=dev).manual_seed(gen.seed)
    done = [0]

    def run_step(a, hi, rows, reducer):
        resident = layout.device_bytes + INPUT_BYTES_PER_TOKEN * B * (W - (hi - a))
        step = block_step(canvas.ids, canvas.pads, BlockCacheStep(a, hi, bl, W, store, resident),
                          rows=rows, reducer=reducer)
        store.begin("block", a, W)          # cold layers: prefetch the stored columns [0, a)
        outs = engine._execute(step, probe)
        store.finish()
        return outs

    def after(masked):
        done[0] += 1
        if on_step:
            on_step(done[0], canvas.standard(pad))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    try:
        stats = sampler.run_blocks(run_step, canvas, gen, generator, after)
    finally:
        engine._end_request()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    tokens = canvas.answers().cpu()
    stats |= {"kv_tier": layout.tier, "hot_layers": layout.hot, "kv_device_bytes": layout.device_bytes,
              "kv_host_bytes": layout.host_bytes, "kv_transfer_bytes": store.transfer_bytes,
              "kv_bytes_per_token": 2 * cfg.num_layers * cfg.kv_dim * model.dtype.itemsize}
    lossy = sampler.lossy_labels(gen, dev, False) + engine.lossy_options(None)
    return result_type([engine.decode(t) for t in tokens], tokens, canvas.standard(pad).cpu(), "planned",
                       stats["nfe"], seconds, engine.peak_device_bytes(), gen, lossy, stats, "resident",
                       list(model.precision))
