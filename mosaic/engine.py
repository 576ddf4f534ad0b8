"""MosaicEngine: prompts in, tokens out, through the native or the planned path.

The facade composes the layers below it: a sampler object for the model's family (runtime/
samplers), the one prepare (policy/prepare.py) with its chunk policy, admission against the
budget (policy/admission.py), and the runners that execute a prepared step (runtime/runner.py)."""

from __future__ import annotations

import dataclasses
import functools
import resource
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from . import kernels, warmup
from . import prompts as prompts_mod
from .config import EngineConfig, GenerationConfig
from .config_file import is_config_path, load_engine_config
from .errors import InputError, MemoryBudgetError, gib
from .graph.shard import current, world
from .loader import load
from .memory.accounting import FIXED_BYTES, Budget, arena_bytes, context_bytes
from .memory.arena import make_arena
from .memory.kv_store import KVStore, StoreLayout
from .memory.transient import DeviceGuard
from .models import Model
from .models.kv_cache import cached_step
from .models.step import make_step
from .policy import timeline
from .policy.admission import Admission, admit, alone, resident_bytes
from .policy.chunking import chunk_policy
from .policy.kv_tier import admit_cached
from .policy.prepare import Preparer
from .policy.probe import probe_step
from .prompts import LengthWarning  # noqa: F401  (re-exported: mosaic.LengthWarning)
from .runtime import parallel
from .runtime.runner import NativeRunner, PlannedRunner
from .runtime.samplers import sampler_for
from .runtime.samplers.base import SHARED_OPTIONS
from .runtime.templates import TemplateCache

ALIASES = {"gen_length": "max_new_tokens"}


@dataclass
class Generation:
    """The result of generate(): texts, tokens [B, max_new_tokens] and sequences [B, prompt +
    max_new_tokens] (on the CPU), the path taken, steps, seconds, the device peak (bytes) and
    the labels of options that may change tokens relative to the reference sampler."""
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

    @property
    def text(self) -> str:
        return self.texts[0]


class Canvas(NamedTuple):
    """ids [B, P + G] (left-padded prompts then mask ids), valid [B, P + G] bool or None (no
    padding), prompt_len P."""
    ids: torch.Tensor
    valid: torch.Tensor | None
    prompt_len: int


class MosaicEngine:
    """A model and how to run it. model: a Model, a checkpoint folder, a bundled model name
    ('tiny-llada', 'tiny-dream') or a preset ('llada-8b', 'dream-7b', 'llada-moe-7b'); config:
    an EngineConfig, a dict of its fields, or a YAML file of them (config_file.py). Raises
    CheckpointError / InputError on bad input."""

    def __init__(self, model: Model | str | Path, config: EngineConfig | dict | str | Path | None = None):
        self.config = cfg = load_engine_config(config) if is_config_path(config) else EngineConfig.coerce(config)
        if not isinstance(model, Model):
            model = load(model, cfg.device, cfg.dtype)
        self.model = model
        dev = model.device
        for setting in (cfg.logits_kernel, cfg.elementwise_kernel):  # an impossible choice fails here
            kernels.want_triton(dev.type, setting)
        self.sampler = sampler_for(model.cfg)
        if cfg.sparse is not None:
            top = max((r.layers[1] for r in cfg.sparse.ranges), default=-1)
            if top >= model.cfg.num_layers:
                raise InputError(f"sparse ranges reach layer {top}, but {model.name} has layers "
                                 f"0-{model.cfg.num_layers - 1}")
        # several processes: NCCL's buffers exist (warm-up) before the context is measured, and
        # every rank charges the largest context of any rank (same budgets, same chunk choices)
        context = parallel.startup_context(dev) if world()[1] > 1 else None
        self.budget = Budget.of(cfg.memory_budget, dev, model.weight_bytes(), context)
        if self.budget.budget_bytes is not None and self.budget.budget_bytes <= self.budget.fixed_bytes:
            b = self.budget
            raise MemoryBudgetError(
                f"memory budget {gib(b.budget_bytes)} is below what {model.name} holds before any token: "
                f"weights {gib(b.weights_bytes)} + context and workspace {gib(b.fixed_bytes - b.weights_bytes)}"
                f" = {gib(b.fixed_bytes)}", needed_bytes=b.fixed_bytes, budget_bytes=b.budget_bytes, max_tokens=0)
        self.arena = make_arena(dev, cfg.arena)
        self.templates = TemplateCache(model, cfg.planner, cfg.logits_kernel, cfg.attention)

        def limit(step):  # a block cache's persistent K/V are not the step's to use
            free = self.budget.activation_limit(step.batch, step.length, step.shard_slots)
            return None if free is None else free - resident_bytes(step)
        self.preparer = Preparer(self.templates, chunk_policy(cfg.chunks, limit, cfg.max_chunks,
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
        self.warmup_report: dict | None = None
        if dev.type == "cuda" and self.budget.budget_bytes is not None and world()[1] == 1:
            self.warm_up()
        # admission may run on a server's thread while generate() runs on another: both go
        # through the one preparer (its caches), one at a time
        self.lock = threading.RLock()
        if cfg.max_length and not cfg.native and self.budget.budget_bytes is not None:
            self._check_max_length(cfg.max_length)

    def sampler_for(self, gen: GenerationConfig):
        """The sampler of this request: the family's, or its Fast-dLLM variant when `gen` asks
        for a cache, a threshold or a factor."""
        return sampler_for(self.model.cfg, gen) if gen.accelerated else self.sampler

    # -- the budget on the device (docs/MEMORY.md)
    def warm_up(self) -> dict:
        """Measure the workspace a step leaves on the device (mosaic/warmup.py), charge it instead
        of the FIXED_BYTES guess, and from then on run every planned step under the device guard:
        out-of-plan transients from a pre-reserved pool, PyTorch capped at the budget's rest."""
        self.warmup_report = rep = warmup.warm_up(self)
        self.budget = self.budget.with_workspace(rep["workspace_bytes"])
        self.guard = warmup.make_guard(self, rep)
        self.arena.exact = True
        # the guard caps PyTorch itself: no cache trimming; callbacks hold no engine reference
        self.runner.on_step_done = None
        self.runner.before_step = functools.partial(_guard_step, self.guard, self.arena)
        self.runner.scope = self.guard.scope
        return rep

    def _begin_request(self) -> None:
        """After admission, before the request's first tensor: the arena cut to its plan, the
        cache of earlier requests handed back, PyTorch capped (memory/transient.py)."""
        if self.guard is not None and self.last_admission is not None:
            _guard_begin(self.guard, self.arena, self.last_admission.prepared)

    def _end_request(self) -> None:
        if self.guard is not None:
            self.guard.end()

    @property
    def history(self):
        """StepStats of every planned step run so far (policy/prepare.py)."""
        return self.preparer.history

    # -- request preparation
    def generation_config(self, config=None, **overrides) -> GenerationConfig:
        """Explicit arguments > generation_config.json > built-in defaults (HF convention).
        generation_config.json fields this family's sampler does not read (an autoregressive
        top_p on a LLaDA checkpoint, say) are left out, with a warning."""
        known = {f.name for f in dataclasses.fields(GenerationConfig)}
        own = SHARED_OPTIONS | self.sampler.options
        merged = {ALIASES.get(k, k): v for k, v in self.model.generation_defaults.items()}
        merged = {k: v for k, v in merged.items() if k in known and v is not None}
        foreign = sorted(k for k in merged if k not in own)
        if foreign:
            merged = {k: v for k, v in merged.items() if k in own}
            warnings.warn(f"generation_config.json sets {foreign}, which the {self.sampler.display} sampler does "
                          "not read: left out", UserWarning, stacklevel=3)
        if config is not None:
            base = GenerationConfig.coerce(config)
            merged |= {f: getattr(base, f) for f in known if f != "extra"}
        unknown = sorted(set(overrides) - known - set(ALIASES))
        if unknown:
            raise InputError(f"unknown generation options {unknown}; known: {sorted(known)}")
        merged |= {ALIASES.get(k, k): v for k, v in overrides.items() if v is not None}
        return GenerationConfig(**merged)

    def encode(self, prompt, chat: bool = False) -> list[list[int]]:
        """Text, token ids, chat messages, or a list of those -> token id lists (prompts.py)."""
        return prompts_mod.encode(self.model, prompt, chat)

    def unpad(self, inputs, attention_mask) -> tuple[list[list[int]], int]:
        """Prompt id lists and the padded width from a left-padded batch and its attention mask."""
        return prompts_mod.unpad(self.model, inputs, attention_mask)

    def canvas(self, prompts: list[list[int]], gen_len: int, width: int | None = None) -> Canvas:
        """Left-padded prompts (to `width`, default the longest) followed by gen_len mask ids,
        on the model's device. Padding positions hold a token that is never read (their keys are
        masked); LLaDA's positions count them, so `width` keeps a caller's padded width."""
        cfg = self.model.cfg
        P = max(max(len(p) for p in prompts), width or 0)
        pad = self.pad_filler()
        x = torch.full((len(prompts), P + gen_len), cfg.mask_id, dtype=torch.long)
        valid = torch.ones_like(x, dtype=torch.bool)
        for i, p in enumerate(prompts):  # left padding
            x[i, : P - len(p)] = pad
            valid[i, : P - len(p)] = False
            x[i, P - len(p): P] = torch.tensor(p)
        dev = self.model.device
        return Canvas(x.to(dev), None if bool(valid.all()) else valid.to(dev), P)

    def pad_filler(self) -> int:
        """The id left padding is filled with (never the mask token)."""
        return prompts_mod.pad_filler(self.model.cfg)

    def check(self, prompts: list[list[int]], gen: GenerationConfig, width: int | None = None) -> None:
        """Every argument error before any work starts: the sampler's options (its check), then
        prompts and lengths (here). Warns once (LengthWarning) when prompt + max_new_tokens
        exceeds the length the model was trained for."""
        prompt_len = max(max(len(p) for p in prompts), width or 0)
        self.sampler_for(gen).check(gen, prompt_len)
        prompts_mod.check_prompts(self.model.cfg, prompts)
        total = prompt_len + gen.max_new_tokens
        dream = self.model.cfg.family == "dream"
        draws = gen.temperature > 0 or (gen.alg == "origin" or bool(gen.alg_temp) if dream else
                                        gen.remasking == "random")
        if world()[1] > 1 and gen.seed is None and draws:  # each process's global generator is its own
            raise InputError("across several processes pass seed=N, so that every process draws the same "
                             "random numbers (the command line always does: --seed, default 0)")
        if gen.cache != "none" and world()[1] > 1:
            raise InputError("a block cache (cache 'prefix'/'dual') is not available across several processes "
                             "yet; use cache='none' or one process")
        if gen.accelerated and self.config.sparse is not None:
            raise InputError("block-sparse attention and the Fast-dLLM samplers cannot be combined yet")
        if world()[1] > 1 and self.model.cfg.family == "dream" and gen.temperature > 0:
            raise InputError("Dream sampling at temperature > 0 is not available across several "
                             "processes yet (its random draws depend on every rank's rows)")
        limit = self.config.max_length
        if self.config.sparse is not None and world()[1] > 1:
            raise InputError("block-sparse attention is not available across several processes yet")
        if limit and total > limit:
            raise InputError(f"prompt ({prompt_len} tokens) + max_new_tokens ({gen.max_new_tokens}) = "
                             f"{total} exceeds max_length {limit}")
        if total > self.model.cfg.max_seq_len and not self._warned_length:
            self._warned_length = True
            prompts_mod.warn_length(prompt_len, gen.max_new_tokens, self.model.cfg.max_seq_len)

    def admit(self, batch: int, length: int, gen: GenerationConfig) -> Admission:
        """Admit a request of `batch` sequences of `length` tokens or raise MemoryBudgetError
        (before anything is allocated) naming the longest that fits. Thread-safe."""
        sampler, num_ranks = self.sampler_for(gen), world()[1]

        def step_for(n: int, masked: int):
            return probe_step(self.model, n, masked, gen, batch=batch, cfg_pair=sampler.cfg_pair(gen),
                              shard=self._shard(n))
        rows = sampler.admit_rows(gen, length) if hasattr(sampler, "admit_rows") else sampler.first_masked(gen)
        self.last_store_layout = None
        if getattr(sampler, "uses_cache", lambda g: False)(gen):
            itemsize = self.model.embed.element_size()
            layout_for = lambda n, hot: StoreLayout.of(self.model.cfg, batch, n, itemsize, hot)  # noqa: E731
            self.last_admission, self.last_store_layout = admit_cached(
                self.preparer, self.budget, step_for, length, rows * batch, layout_for, self.config.kv_tier,
                min_length=num_ranks)
            return self.last_admission
        sp = self.config.sparse   # its steps after the dense ones must fit too
        variants = (lambda s: s.with_(sparse=sp),) if sp is not None else ()
        # several processes: every rank admits its own share and all reach the same decision
        agree = (lambda v: parallel.agree(v, self.model.device)) if num_ranks > 1 else alone  # noqa: E731
        with self.lock:
            self.last_admission = admit(self.preparer, self.budget, step_for, length,
                                        rows * batch, min_length=num_ranks, variants=variants,
                                        agree=agree, world=num_ranks)
            return self.last_admission

    def _check_max_length(self, length: int) -> None:
        """max_seq_len (max_length) must fit the budget: a request of that many tokens whose
        canvas is the default max_new_tokens (at most half of it) is admitted, or this raises
        MemoryBudgetError with the longest that fits."""
        default = self.generation_config().max_new_tokens
        probe = GenerationConfig(max_new_tokens=max(1, min(default, length // 2)))
        try:
            self.admit(1, length, probe)
        except MemoryBudgetError as e:
            raise MemoryBudgetError(
                f"max_seq_len {length:,} does not fit the memory budget ({gib(e.budget_bytes)}): a request of "
                f"{length:,} tokens needs at least {gib(e.needed_bytes)}; longest that fits: {e.max_tokens:,} "
                f"tokens", needed_bytes=e.needed_bytes, budget_bytes=e.budget_bytes, max_tokens=e.max_tokens) from None

    def mask_ratio_config(self, gen: GenerationConfig, prompt_len: int, mask_ratio: float,
                          cap: int | None = None) -> GenerationConfig:
        """The paper's `mask_ratio`: the share of the whole sequence (prompt + canvas) that is
        masked when denoising starts, i.e. generated. The canvas is G = floor(r * P / (1 - r))
        tokens for a P-token prompt (so G / (P + G) <= r), at most `cap` (an explicit
        max_new_tokens), rounded down to a multiple of block_length when one is set. The tokens
        are exactly those of generate(..., max_new_tokens=G): nothing else changes.
        Raises InputError for r outside (0, 1) or a canvas of zero tokens."""
        if isinstance(mask_ratio, bool) or not isinstance(mask_ratio, (int, float)) or not 0 < mask_ratio < 1:
            raise InputError(f"mask_ratio={mask_ratio!r} must be a number in (0, 1): the share of prompt + canvas "
                             "that is generated")
        G = int(mask_ratio * prompt_len / (1 - mask_ratio) + 1e-9)
        if cap is not None:
            G = min(G, cap)
        unit = gen.block_length or 1
        G -= G % unit
        if G < 1:
            raise InputError(f"mask_ratio {mask_ratio} of a {prompt_len}-token prompt leaves a canvas of "
                             f"{G} tokens; at least {unit} needed (raise mask_ratio or max_new_tokens)")
        return dataclasses.replace(gen, max_new_tokens=G)

    def kv_store(self, batch: int, length: int, gen: GenerationConfig) -> KVStore:
        """The K/V store of a cached request, laid out as its admission chose (every layer on the
        device when nothing was admitted, or kv_tier='host': every layer on the host)."""
        layout = self.last_store_layout
        if layout is None or (layout.batch, layout.length) != (batch, length):
            hot = 0 if self.config.kv_tier == "host" else None
            layout = StoreLayout.of(self.model.cfg, batch, length, self.model.embed.element_size(), hot)
        return KVStore(layout, self.model.device, self.model.dtype)

    def _shard(self, length: int):
        return current(length, self.config.peer_rows, self.config.peer_overlap)

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
        if not use_native:  # refuse before anything is allocated on the device
            plen = max(max(len(p) for p in prompts), width or 0)
            self.admit(len(prompts), plen + gen.max_new_tokens, gen)
            self._begin_request()
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
        predict = self._predictor(gen, generator, valid, use_native, probe, sampler, store)
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
        lossy = sampler.lossy_labels(gen, dev, use_native) + ([] if use_native else self.lossy_options())
        stats = {}
        if fast:
            # nfe: forwards of this (batched) run; nfe_per_row: the forwards each row would take alone
            stats = {"nfe": done[0], "cache": gen.cache, "threshold": gen.threshold, "factor": gen.factor,
                     "nfe_per_token": done[0] / gen.max_new_tokens,
                     "nfe_per_row": getattr(sampler, "last_row_nfe", None)}
            if store is not None:
                lay = store.layout
                stats |= {"kv_tier": lay.tier, "hot_layers": lay.hot, "kv_device_bytes": lay.device_bytes,
                          "kv_host_bytes": lay.host_bytes, "kv_transfer_bytes": store.transfer_bytes}
        if world()[1] > 1 and self.model.dtype != torch.float32:
            lossy = [*lossy, parallel.LOSSY]
        return Generation(texts, tokens, x.cpu(), "native" if use_native else "planned",
                          done[0] if fast else total_steps, seconds, self.peak_device_bytes(), gen, lossy, stats)

    def lossy_options(self) -> list[str]:
        """Engine options of the planned path that may change tokens relative to the reference."""
        cfg, out = self.config, []
        if cfg.attention != "sdpa":
            out.append(f"attention={cfg.attention}: its bf16 rounding may differ from PyTorch's SDPA order")
        if cfg.sparse is not None:
            rs = ", ".join(f"layers {r.layers[0]}-{r.layers[1]} {r.pattern}"
                           + (f" keep {r.keep:g}" if r.pattern == "topk" else "") for r in cfg.sparse.ranges)
            out.append(f"block-sparse attention after {cfg.sparse.dense_steps} dense steps ({rs})")
        return out

    def _predictor(self, gen, generator, valid, native: bool, probe=None, sampler=None, store=None):
        sampler = sampler or self.sampler
        if native:
            forward = lambda ids, v: self.native_runner.forward(ids, v, probe)  # noqa: E731
            return sampler.native_predict(forward, gen, generator, valid)
        return sampler.planned_predict(self._run_rows(valid, probe, store), gen, generator)

    def _run_rows(self, valid, probe=None, store=None):
        """run_rows for the planned predict functions: prepare, then execute (per rank). Counts
        the request's steps: block-sparse attention starts after the sparse config's dense_steps.
        cache (a models.kv_cache.CacheStep without its store): a fill or block step of `store`."""
        done = [0]

        def run(ids, rows, rows_u, reducer, positions=None, cache=None):
            B, L = ids.shape
            v = valid if (rows_u is None or valid is None) else torch.cat([valid, valid])
            if cache is not None:
                spec = dataclasses.replace(cache, store=store, resident_bytes=store.layout.device_bytes)
                step = cached_step(self.model.cfg, ids, v, spec, rows=rows, reducer=reducer)
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
                return self._execute(make_step(self.model.cfg, ids, v, rows=rows, rows_uncond=rows_u,
                                               reducer=reducer, sparse=sparse), probe)
            # this rank's slots only; every rank gets every slot's result back (all ranks run)
            pos = rows if positions is None else positions
            shift = self.model.cfg.logit_shift
            idx, local = parallel.localize(pos, L, B if rows_u is None else 2 * B, shard, shift)
            local_u = None if rows_u is None else parallel.localize(rows_u, L, 2 * B, shard, shift)[1]
            step = make_step(self.model.cfg, ids, v, rows=local, rows_uncond=local_u,
                             reducer=reducer.subset(idx), shard=shard, masked_total=int(rows.shape[0]))
            return parallel.gather_outs(self._execute(step, probe), idx, int(rows.shape[0]), shard)
        return run

    def _execute(self, step, probe=None):
        with self.lock:
            prepared = self.preparer.prepare(step)
        return self.runner.execute(step, prepared, probe)

    # -- one step (benchmarks, tests)
    def step(self, ids: torch.Tensor, *, native: bool = False, config=None, seed: int = 0, probe=None):
        """One prediction of this model's sampler on canvas ids [B, L] with every masked position
        a candidate: (x0 [B, L] or [M], confidence). probe(ctx, op) is called after every op."""
        gen = self.generation_config(config, max_new_tokens=1)
        g = torch.Generator(device=self.model.device).manual_seed(seed)
        try:
            return self.sampler.one_step(self._predictor(gen, g, None, native, probe), ids)
        finally:
            self._end_request()

    def forward_logits(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       probe=None) -> torch.Tensor:
        """The native forward: logits [B, L, V] for ids [B, L] (attention_mask: 1 = token)."""
        valid = None if attention_mask is None else attention_mask.bool()
        return self.native_runner.forward(ids, valid, probe)

    def decode(self, ids) -> str:
        """Token ids -> text, up to the first end-of-text, mask ids dropped."""
        tok = self.model.tokenizer
        cfg = self.model.cfg
        ids = [int(i) for i in ids]
        ends = [j for j, i in enumerate(ids) if i == cfg.eos_id or i in cfg.extra_eos_ids]
        if ends:  # the answer ends at the first end-of-text
            ids = ids[: ends[0]]
        if tok is None:
            return " ".join(map(str, ids))
        return tok.decode([i for i in ids if i != cfg.mask_id])

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

    def memory_report(self) -> dict:
        """Where the device memory is: weights, arena, PyTorch's allocator, context, budget (bytes)."""
        dev = self.model.device
        adm = self.last_admission
        rep = {"device": str(dev), "weights_bytes": self.model.weight_bytes(),
               "arena": self.arena.kind, "arena_mapped_bytes": self.arena.mapped_bytes,
               "arena_peak_bytes": self.arena.peak_bytes, "budget_bytes": self.budget.budget_bytes,
               "last_prediction_bytes": adm.predicted_bytes if adm else None,
               "workspace_bytes": self.budget.workspace_bytes,
               "torch_limit_bytes": self.guard.limit_bytes if self.guard else None,
               "torch_last_limit_bytes": self.guard.last_limit_bytes if self.guard else None}
        if dev.type == "cuda":
            free, total = torch.cuda.mem_get_info(dev)
            rep |= {"torch_reserved_bytes": torch.cuda.memory_reserved(dev),
                    "torch_peak_reserved_bytes": torch.cuda.max_memory_reserved(dev),
                    "context_bytes": context_bytes(dev) - self.arena_extra_bytes(now=True),
                    "device_used_bytes": total - free, "device_total_bytes": total}
        return rep

    def peak_device_bytes(self) -> int:
        """PyTorch's peak reserved + the arena's mapped peak (GPU); the process RSS peak (CPU)."""
        dev = self.model.device
        if dev.type == "cuda":
            return int(torch.cuda.max_memory_reserved(dev)) + self.arena_extra_bytes()
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def arena_extra_bytes(self, now: bool = False) -> int:
        """Arena bytes PyTorch's allocator does not count (the virtual-memory arena's pages)."""
        if self.arena.kind != "vmm":
            return 0
        return self.arena.physical_bytes if now else self.arena.peak_bytes

    def memory_plot(self, prompts, gen: GenerationConfig, path: str) -> dict:
        """The first step of this request as a PNG: Mosaic's plan, the native forward recorded,
        and on a GPU both paths measured op by op. Returns the series (bytes per op)."""
        if world()[1] > 1:
            raise InputError("memory plots are drawn for one process: run without --gpus")
        canvas = self.canvas(self.encode(prompts), gen.max_new_tokens)
        B, L = canvas.ids.shape
        step = probe_step(self.model, L, self.sampler.first_masked(gen) * B, gen, batch=B,
                          cfg_pair=self.sampler.cfg_pair(gen))
        prepared = self.preparer.prepare(step, remember=False)
        series = {"Mosaic (planned)": timeline.planned_series(prepared.template),
                  "native forward (recorded, no sampler)": timeline.native_series(self.model, B, L)}
        if self.model.device.type == "cuda":
            one = {"block_length": gen.max_new_tokens} if "block_length" in self.sampler.options else {}
            for native in (True, False):
                probe = timeline.Probe(self.model.device)
                self.generate(prompts, config=gen, native=native, steps=1, progress=False, probe=probe,
                              max_new_tokens=gen.max_new_tokens, **one)
                base = torch.cuda.memory_allocated(self.model.device)
                series[f"{'native' if native else 'Mosaic'} (measured)"] = [
                    u - base + self.arena.mapped_bytes * (not native) for _, u, _ in probe.samples]
        timeline.plot(series, path, f"{self.model.name}: one step, N = {L:,} x {B}")
        return series


def _guard_step(guard, arena, prepared) -> None:
    """Before a planned step under a budget: the arena cut down to its plan, then the transient
    pool and PyTorch's cap for it (the arena grows after, in the runner)."""
    guard.before_step(prepared.external_bytes, _outside_pages(arena, prepared), arena, prepared.plan_bytes)


def _guard_begin(guard, arena, prepared) -> None:
    """At a request's start: the same for its first (admitted) step, with the cache emptied."""
    guard.begin(prepared.external_bytes, _outside_pages(arena, prepared), arena, prepared.plan_bytes)


def _outside_pages(arena, prepared) -> int:
    return arena_bytes(prepared.plan_bytes, arena.gran) if arena.kind == "vmm" else 0


def _trim_cache(dev, budget, arena, prepared) -> None:
    """Under a budget, hand PyTorch's cached blocks back when they exceed what the plan expects
    outside the arena (the caching allocator keeps freed blocks reserved)."""
    if dev.type != "cuda" or budget.budget_bytes is None:
        return
    allowance = prepared.external_bytes + FIXED_BYTES + resident_bytes(prepared.step) + \
        (prepared.plan_bytes if arena.kind == "host" else 0)
    if torch.cuda.memory_reserved(dev) > allowance:
        torch.cuda.empty_cache()


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="denoising", unit="step", leave=False)
