"""What the engine reports about memory: the parts it holds (memory_report), one step drawn as a
plot (memory_plot), and the per-layer precision it applied at start."""

from __future__ import annotations

import torch

from ..errors import InputError
from ..graph.shard import world
from ..kernels.fp8 import cuda_fp8_error
from ..memory.accounting import context_bytes
from ..models.precision import FP8_NAME, quantize_embedding, ranges
from ..models.precision import apply_precision as apply_dtypes
from ..policy import timeline
from ..policy.offload import candidates, mode_of, offload_of
from ..policy.precision import plan_precision
from ..policy.probe import probe_step


def apply_precision(model, pc) -> dict | None:
    """Per-layer FP8 (config.precision): explicit ranges or chosen by sensitivity; the report of
    what was applied (None: the model dtype everywhere). InputError where FP8 cannot run."""
    if pc is None:
        return None
    err = cuda_fp8_error(model.device)
    if err:
        raise InputError(err)
    rep = plan_precision(model, pc)
    apply_dtypes(model, rep["dtypes"])
    if pc.embed == FP8_NAME:
        quantize_embedding(model)
    rep["dtypes"] = list(model.precision)
    rep["ranges"] = ranges(model.precision)
    rep["weight_bytes"] = model.weight_bytes()
    return rep


def memory_report(engine, admission=None) -> dict:
    """Where the memory is: weights (on the device and in host memory), arena, PyTorch's
    allocator, context, budget, the guard's cap, the offload mode and precision (bytes).
    admission: a request's Admission (its prediction and mode), else the engine's first mode."""
    mem, dev = engine.memory, engine.model.device
    guard = mem.guard
    offload = admission.offload if admission is not None else \
        offload_of(candidates(engine.config)[0], engine.config, engine.model.cfg)
    rep = {"device": str(dev), "weights_bytes": engine.model.weight_bytes(),
           "arena": mem.arena.kind, "arena_mapped_bytes": mem.arena.mapped_bytes,
           "arena_peak_bytes": mem.arena.peak_bytes, "budget_bytes": mem.budget.budget_bytes,
           "last_prediction_bytes": admission.predicted_bytes if admission is not None else None,
           "workspace_bytes": mem.budget.workspace_bytes, "others_bytes": mem.others_bytes,
           "torch_limit_bytes": guard.limit_bytes if guard else None,
           "torch_last_limit_bytes": guard.last_limit_bytes if guard else None,
           "offload": mode_of(offload), "host_weights_bytes": mem.placement.host_bytes,
           "host_kv_bytes": mem.host_pool.nbytes, "precision": engine.precision_report}
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        rep |= {"torch_reserved_bytes": torch.cuda.memory_reserved(dev),
                "torch_peak_reserved_bytes": torch.cuda.max_memory_reserved(dev),
                "context_bytes": context_bytes(dev) - mem.arena_extra_bytes(now=True),
                "device_used_bytes": total - free, "device_total_bytes": total}
    return rep


def memory_plot(engine, prompts, gen, path: str) -> dict:
    """The first step of this request as a PNG: Mosaic's plan, the native forward recorded, and
    on a GPU both paths measured op by op. Returns the series (bytes per op)."""
    if world()[1] > 1:
        raise InputError("memory plots are drawn for one process: run without --gpus")
    model, sampler = engine.model, engine.sampler
    canvas = engine.canvas(engine.encode(prompts), gen.max_new_tokens)
    B, L = canvas.ids.shape
    off = offload_of(candidates(engine.config)[0], engine.config, model.cfg)
    step = probe_step(model, L, sampler.first_masked(gen) * B, gen, batch=B,
                      cfg_pair=sampler.cfg_pair(gen)).with_(offload=off)
    prepared = engine.preparer.prepare(step, remember=False)
    series = {"Mosaic (planned)": timeline.planned_series(prepared.template),
              "native forward (recorded, no sampler)": timeline.native_series(model, B, L)}
    if model.device.type == "cuda":
        one = {"block_length": gen.max_new_tokens} if "block_length" in sampler.options else {}
        for native in (True, False):
            probe = timeline.Probe(model.device)
            engine.generate(prompts, config=gen, native=native, steps=1, progress=False, probe=probe,
                            max_new_tokens=gen.max_new_tokens, **one)
            base = torch.cuda.memory_allocated(model.device)
            series[f"{'native' if native else 'Mosaic'} (measured)"] = [
                u - base + engine.arena.mapped_bytes * (not native) for _, u, _ in probe.samples]
    timeline.plot(series, path, f"{model.name}: one step, N = {L:,} x {B}")
    return series
