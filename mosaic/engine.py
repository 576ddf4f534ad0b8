"""MosaicEngine: prompts in, tokens out, through the native or the planned path.

The facade composes the layers below it: a sampler object for the model's family (runtime/
samplers), the one prepare (policy/prepare.py) with its chunk policy, admission against the
budget of each offload mode (policy/admission.py, engine_memory.py), and the runners that execute
a prepared step (runtime/runner.py). Request preparation (options, prompts, canvas, checks) is in
engine_requests.py; budgets, admission, the warm-up and guard, and memory reports in
engine_memory.py."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import kernels
from .config import EngineConfig, GenerationConfig
from .config_file import is_config_path, load_engine_config
from .engine_memory import MemoryMixin, _trim_cache
from .engine_requests import ALIASES, Canvas, RequestsMixin  # noqa: F401  (Canvas, ALIASES: public names)
from .errors import InputError
from .graph.shard import world
from .loader import load
from .memory.arena import make_arena
from .memory.kv_store import StoreLayout
from .memory.transient import DeviceGuard
from .models import Model
from .models.kv_cache import cached_step
from .models.step import make_step
from .policy.admission import Admission
from .policy.chunking import chunk_policy
from .policy.offload import candidates, mode_of, offload_of
from .policy.prepare import Preparer
from .prompts import LengthWarning  # noqa: F401  (re-exported: mosaic.LengthWarning)
from .runtime import parallel
from .runtime.placement import WeightPlacement
from .runtime.runner import NativeRunner, PlannedRunner
from .runtime.samplers import sampler_for
from .runtime.templates import TemplateCache


@dataclass
class Generation:
    """The result of generate(): texts, tokens [B, max_new_tokens] and sequences [B, prompt +
    max_new_tokens] (on the CPU), the path taken, steps, seconds, the device peak (bytes), the
    labels of options that may change tokens relative to the reference sampler, the Fast-dLLM
    statistics, the offload mode that ran and each layer's weight precision."""
    texts: list[str]
    tokens: torch.Tensor
    sequences: torch.Tensor
    path: str                     # "native" or "planned"
    steps: int
    seconds: float
    peak_device_bytes: int
    config: GenerationConfig
    lossy: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)   # Fast-dLLM: nfe, cache, kv tier (docs/FAST_DECODING.md)
    offload: str = "resident"     # resident | weights | weights+kv (policy/offload.py)
    precision: list[str] = field(default_factory=list)   # per layer weight dtype

    @property
    def text(self) -> str:
        return self.texts[0]


def check_sparse_layers(sparse, model) -> None:
    """InputError when a sparse range names a layer the model does not have (engine and plan)."""
    top = max((r.layers[1] for r in sparse.ranges), default=-1) if sparse is not None else -1
    if top >= model.cfg.num_layers:
        raise InputError(f"sparse ranges reach layer {top}, but {model.name} has layers 0-{model.cfg.num_layers - 1}")


class MosaicEngine(RequestsMixin, MemoryMixin):
    """A model and how to run it. model: a Model, a checkpoint folder, a bundled model name
    ('tiny-llada', 'tiny-dream') or a preset ('llada-8b', 'dream-7b', 'llada-moe-7b'); config:
    an EngineConfig, a dict of its fields, or a YAML file of them (config_file.py). Raises
    CheckpointError / InputError on bad input, MemoryBudgetError for a budget below the weights."""

    def __init__(self, model: Model | str | Path, config: EngineConfig | dict | str | Path | None = None):
        self.config = cfg = load_engine_config(config) if is_config_path(config) else EngineConfig.coerce(config)
        if not isinstance(model, Model):
            model = load(model, cfg.device, cfg.dtype)
        self.model = model
        dev = model.device
        for option in ("logits_kernel", "elementwise_kernel"):  # an impossible choice fails here
            kernels.want_triton(dev.type, getattr(cfg, option), option)
        if cfg.attention == "triton":   # Mosaic's attention kernel: CUDA (or the CPU interpreter)
            kernels.want_triton(dev.type, "triton", "attention")
        if cfg.attention == "cudnn" and dev.type != "cuda":
            raise InputError(f"attention 'cudnn' needs a CUDA device (here: {dev.type}); on a CPU attention "
                             "is PyTorch's SDPA: use attention='sdpa' (the default)")
        self.sampler = sampler_for(model.cfg)
        check_sparse_layers(cfg.sparse, model)
        self.precision_report = self._apply_precision(cfg.precision)   # before the weights are charged
        self._budgets(dev)               # self.budget, self.offload_budget (engine_memory.py)
        self.placement = WeightPlacement(model, dev)
        self.offload = offload_of(candidates(cfg)[0], cfg, model.cfg)   # the last admitted request's mode
        self.arena = make_arena(dev, cfg.arena)
        self.templates = TemplateCache(model, cfg.planner, cfg.logits_kernel, cfg.attention)
        self.preparer = Preparer(self.templates, chunk_policy(cfg.chunks, self._activation_limit, cfg.max_chunks,
                                                              cfg.min_attention_rows))
        self.native_runner = NativeRunner(model)
        # the callback holds the parts it needs, not the engine: no reference cycle keeps a dropped
        # engine (and its arena's mapped pages) alive until the garbage collector runs
        self.runner = PlannedRunner(model, self.arena, sanitize=cfg.sanitize, logits_kernel=cfg.logits_kernel,
                                    attention=cfg.attention,
                                    on_step_done=functools.partial(_trim_cache, dev, self.budget, self.arena),
                                    elementwise_kernel=cfg.elementwise_kernel)
        self.last_admission: Admission | None = None
        self._warned_length = False
        self.last_store_layout: StoreLayout | None = None
        self.guard: DeviceGuard | None = None
        self._guard_phantom = 0
        self.warmup_report: dict | None = None
        # admission may run on a server's thread while generate() runs on another: both go
        # through the one preparer (its caches), one at a time
        self.lock = threading.RLock()
        if dev.type == "cuda" and self.budget.budget_bytes is not None and world()[1] == 1:
            self.warm_up()
        if cfg.max_length and not cfg.native and self.budget.budget_bytes is not None:
            self._check_max_length(cfg.max_length)

    @property
    def history(self):
        """StepStats of every planned step run so far (policy/prepare.py)."""
        return self.preparer.history

    # -- generation
    def generate(self, prompt=None, max_new_tokens: int | None = None, *, inputs=None, attention_mask=None,
                 steps=None, block_length=None, temperature=None, config=None, native: bool | None = None,
                 chat: bool = False, progress: bool | None = None, on_step=None, probe=None,
                 mask_ratio: float | None = None, **options) -> Generation:
        """Generate for one prompt or a batch (left-padded as the references do).

        prompt (or inputs=, the HF name): text, token ids, chat messages, a list of those, or a
        [B, L] tensor of ids; attention_mask [B, L] (1 = token, 0 = left padding) with a padded
        tensor, as the official generate functions take it. seed=N draws from a private generator
        seeded N; without a seed the draws come from torch's default generator of the model's
        device, as the reference samplers' do (torch.manual_seed(s) before the call reproduces a
        reference run seeded s; the global state is never re-seeded). mask_ratio: the share of
        prompt + canvas that is generated, capped by an explicit max_new_tokens (mask_ratio_config).
        on_step(step_index, canvas [B, L]) is called after every denoising step (streaming; an
        exception it raises stops generation between steps and propagates); probe(ctx, op_name)
        after every op of the model (measurement only: it synchronises).
        Raises InputError for bad arguments and MemoryBudgetError for a request over the budget,
        both before any work starts."""
        if inputs is not None and prompt is not None:
            raise InputError("pass the prompt once: as prompt or as inputs=, not both")
        prompt = inputs if inputs is not None else prompt
        if prompt is None:
            raise InputError("generate() needs a prompt (text, token ids, or inputs=[B, L] ids)")
        gen = self.generation_config(config, max_new_tokens=max_new_tokens, steps=steps,
                                     block_length=block_length, temperature=temperature, **options)
        if attention_mask is not None:
            prompts, width = self.unpad(prompt, attention_mask)
        else:
            prompts, width = self.encode(prompt, chat), None
        if mask_ratio is not None:
            P = max(max(len(p) for p in prompts), width or 0)
            gen = self.mask_ratio_config(gen, P, mask_ratio, max_new_tokens)
        self.check(prompts, gen, width)
        sampler = self.sampler_for(gen)
        use_native = self.config.native if native is None else native
        fast = getattr(sampler, "accelerated", False)
        if fast and use_native:
            raise InputError("cache / threshold / factor (Fast-dLLM) run on the planned path only; "
                             "drop native=True (--native)")
        if use_native and world()[1] > 1:
            raise InputError("the native path runs on one process: use the planned path (the default) "
                             "under several processes, or run the native path without --gpus")
        offload = None
        if not use_native:  # refuse before anything is allocated on the device
            plen = max(max(len(p) for p in prompts), width or 0)
            adm = self.admit(len(prompts), plen + gen.max_new_tokens, gen)
            offload = adm.prepared.step.offload    # this request's mode (admission chose it)
            self._begin_request(adm)
        x, valid, plen = self.canvas(prompts, gen.max_new_tokens, width)
        dev = self.model.device
        generator = None if gen.seed is None else torch.Generator(device=dev).manual_seed(gen.seed)
        total_steps = sampler.max_steps(gen) if fast else sampler.total_steps(gen)
        store = self.kv_store(*x.shape, gen) if fast and sampler.uses_cache(gen) else None
        bar = _progress(total_steps, self.config.progress if progress is None else progress)
        done = [0]

        def after(masked):
            done[0] += 1
            if bar:
                bar.set_postfix(masked=masked)
                bar.update(1)
            if on_step:
                on_step(done[0], x)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        predict = self._predictor(gen, generator, valid, use_native, probe, sampler, store, offload)
        try:
            sampler.run(predict, x, plen, gen, generator, after)
        finally:
            self._end_request()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - t0
        if bar:
            bar.close()
        tokens = x[:, plen:].cpu()
        texts = [self.decode(t) for t in tokens]
        lossy = sampler.lossy_labels(gen, dev, use_native) + ([] if use_native else self.lossy_options(offload))
        if world()[1] > 1 and self.model.dtype != torch.float32:
            lossy = [*lossy, parallel.LOSSY]
        return Generation(texts, tokens, x.cpu(), "native" if use_native else "planned",
                          done[0] if fast else total_steps, seconds, self.peak_device_bytes(), gen, lossy,
                          _fast_stats(gen, sampler, store, done[0]) if fast else {}, mode_of(offload),
                          list(self.model.precision))

    def _predictor(self, gen, generator, valid, native: bool, probe=None, sampler=None, store=None, offload=None):
        sampler = sampler or self.sampler
        if native:
            self._place(None)                  # the published forward reads device weights
            forward = lambda ids, v: self.native_runner.forward(ids, v, probe)  # noqa: E731
            return sampler.native_predict(forward, gen, generator, valid)
        return sampler.planned_predict(self._run_rows(valid, probe, store, offload), gen, generator)

    def _run_rows(self, valid, probe=None, store=None, offload=None):
        """run_rows for the planned predict functions: prepare, then execute (per rank), every
        step in the request's offload mode. Counts the request's steps: block-sparse attention
        starts after the sparse config's dense_steps. cache (a models.kv_cache.CacheStep without
        its store): a fill or block step of `store`."""
        done = [0]

        def run(ids, rows, rows_u, reducer, positions=None, cache=None):
            B, L = ids.shape
            v = valid if (rows_u is None or valid is None) else torch.cat([valid, valid])
            if cache is not None:
                spec = dataclasses.replace(cache, store=store, resident_bytes=store.layout.device_bytes)
                step = cached_step(self.model.cfg, ids, v, spec, rows=rows, reducer=reducer, offload=offload,
                                   dtype=self.model.dtype)
                store.begin(spec.mode, spec.lo, spec.hi)
                outs = self._execute(step, probe)
                store.finish()
                return outs
            shard = self._shard(L)
            sp = self.config.sparse
            sparse = sp if sp is not None and done[0] >= sp.dense_steps else None
            done[0] += 1
            if shard is None:
                if rows.shape[0] == 0:
                    return {k: torch.empty(0, dtype=dt, device=ids.device)
                            for k, dt in reducer.outputs(self.model.dtype)}
                return self._execute(make_step(self.model.cfg, ids, v, dtype=self.model.dtype, rows=rows,
                                               rows_uncond=rows_u, reducer=reducer, sparse=sparse,
                                               offload=offload), probe)
            # this rank's slots only; every rank gets every slot's result back (all ranks run)
            pos = rows if positions is None else positions
            shift = self.model.cfg.logit_shift
            idx, local = parallel.localize(pos, L, B if rows_u is None else 2 * B, shard, shift)
            local_u = None if rows_u is None else parallel.localize(rows_u, L, 2 * B, shard, shift)[1]
            step = make_step(self.model.cfg, ids, v, dtype=self.model.dtype, rows=local, rows_uncond=local_u,
                             reducer=reducer.subset(idx),
                             shard=shard, masked_total=int(rows.shape[0]), offload=offload)
            return parallel.gather_outs(self._execute(step, probe), idx, int(rows.shape[0]), shard)
        run.valid, run.dtype = valid, self.model.dtype    # the samplers' tie-breaking (runtime/ties.py)
        return run

    def _execute(self, step, probe=None):
        self._place(step.offload)          # layers where this mode reads them (engine_memory.py)
        with self.lock:
            prepared = self.preparer.prepare(step)
        return self.runner.execute(step, prepared, probe)

    # -- one step (benchmarks, tests)
    def step(self, ids: torch.Tensor, *, native: bool = False, config=None, seed: int = 0, probe=None):
        """One prediction of this model's sampler on canvas ids [B, L] with every masked position
        a candidate: (x0 [B, L] or [M], confidence), in the engine's current offload mode (the
        last admitted request's). probe(ctx, op) is called after every op."""
        gen = self.generation_config(config, max_new_tokens=1)
        g = torch.Generator(device=self.model.device).manual_seed(seed)
        try:
            return self.sampler.one_step(self._predictor(gen, g, None, native, probe, offload=self.offload), ids)
        finally:
            self._end_request()

    def forward_logits(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       probe=None) -> torch.Tensor:
        """The native forward: logits [B, L, V] for ids [B, L] (attention_mask: 1 = token)."""
        valid = None if attention_mask is None else attention_mask.bool()
        self._place(None)
        return self.native_runner.forward(ids, valid, probe)

    # -- memory
    def close(self) -> None:
        """Release the arena's device memory now (also done when the engine is dropped), and
        the budget guard's transient pool and cap."""
        if self.guard is not None:
            self.guard.close()
        self.arena.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _fast_stats(gen: GenerationConfig, sampler, store, nfe: int) -> dict:
    """Fast-dLLM statistics of a run: nfe, the forwards of this (batched) run; nfe_per_row, the
    forwards each row would take alone; the block cache's tier and bytes."""
    stats = {"nfe": nfe, "cache": gen.cache, "threshold": gen.threshold, "factor": gen.factor,
             "nfe_per_token": nfe / gen.max_new_tokens, "nfe_per_row": getattr(sampler, "last_row_nfe", None)}
    if store is not None:
        lay = store.layout
        stats |= {"kv_tier": lay.tier, "hot_layers": lay.hot, "kv_device_bytes": lay.device_bytes,
                  "kv_host_bytes": lay.host_bytes, "kv_transfer_bytes": store.transfer_bytes}
    return stats


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="denoising", unit="step", leave=False)
