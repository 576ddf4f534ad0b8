"""MosaicEngine: prompts in, tokens out, through the native or the planned path.

The facade composes small objects, each built once with what it needs:

  Requests      options, prompts and every check -> a frozen Request (request.py)
  DeviceMemory  budgets, arena, weight placement, warm-up and guard (device_memory.py)
  Admitter      "does it fit?" and "what is the longest that fits?" (policy/admitter.py)
  Executor      runs the calls a sampler yields on the planned or native runner (steps.py)
  RequestRun    one request's canvas, sampler coroutine, store and statistics (run.py)

  Scheduler     waiting and running RequestRuns, one round per step() (scheduler.py)

generate() = build a Request (a list of prompts: one per prompt) -> admit each -> RequestRuns ->
the Scheduler runs them to their end -> a Generation. Nothing about a request is kept on the
engine: the server's worker holds its own Scheduler of many RequestRuns."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import torch

from ..chat_template import DEFAULT_OPTIONS, ChatOptions
from ..config import EngineConfig, GenerationConfig
from ..config_file import is_config_path, load_engine_config
from ..errors import InputError
from ..graph import tensor
from ..graph.shard import current, world
from ..loader import load, model_name
from ..memory.capture_guard import device_wide
from ..models import Model
from ..models.tensor_shard import check_share, shard_model
from ..policy.admission import Admission, alone
from ..policy.admitter import Admitter
from ..policy.chunking import chunk_policy
from ..policy.features import engine_labels, refuse_config
from ..policy.offload import candidates, offload_of
from ..policy.op_work import CPU_OP_FLOPS
from ..policy.prepare import Preparer
from ..prompts import pad_filler
from ..runtime import parallel
from ..runtime.graph_backend import CudaGraphs
from ..runtime.graphs import StepGraphs
from ..runtime.runner import NativeRunner, PlannedRunner
from ..runtime.samplers import sampler_for
from ..runtime.samplers.base import drive
from ..runtime.templates import TemplateCache
from . import reports
from .blocks import BlockRun
from .checks import check_kernels, check_max_length, check_sparse_layers, set_threads
from .device_memory import DeviceMemory, check_before_load
from .request import Canvas, Request, Requests
from .result import Generation
from .run import RequestRun, make_store
from .scheduler import Scheduler
from .steps import Executor, RowsState

HISTORY_KEEP = 4096   # prepared steps remembered for reports (a long-running process stays flat)


class MosaicEngine:
    """A model and how to run it. model: a Model, a checkpoint folder, a bundled model name
    ('tiny-llada', 'tiny-dream') or a preset ('llada-8b', 'dream-7b', 'llada-moe-7b'); config:
    an EngineConfig, a dict of its fields, or a YAML file of them (config_file.py). Raises
    CheckpointError / InputError on bad input, MemoryBudgetError for a budget below the weights.
    close() (or leaving a `with` block) gives back every byte the engine took."""

    def __init__(self, model: Model | str | Path, config: EngineConfig | dict | str | Path | None = None):
        self.config = cfg = load_engine_config(config) if is_config_path(config) else EngineConfig.coerce(config)
        refuse_config(cfg, procs=world()[1])                   # before the weights load
        self.owns_model = not isinstance(model, Model)
        tp = tensor.current(cfg.parallel)      # tensor parallelism: this rank's heads and FFN columns
        if self.owns_model:
            check_before_load(model_name(model), cfg)   # a budget the weights cannot fit: refused before they load
            model = load(model, cfg.device, cfg.dtype, tensor=tp)
        elif tp is not None and model.tensor is None:   # a Model in memory: this rank's copy of its slices
            model, self.owns_model = shard_model(model, tp), True
        self.model = model
        tp = check_share(model, *world())
        dev = model.device
        check_kernels(cfg, dev, model.dtype, model.cfg)
        set_threads(cfg.threads, model)
        self.sampler = sampler_for(model.cfg)
        refuse_config(cfg, model.cfg.family, self.sampler.block_diffusion, world()[1])
        check_sparse_layers(cfg.sparse, model)
        self.precision_report = reports.apply_precision(model, cfg.precision)   # before the weights are charged
        if cfg.fused_projections != "off" and not model.quantized:   # block steps' GEMMs (models/fusion.py)
            model.fuse_projections(("gate_up", "qkv") if cfg.fused_projections == "all" else ("gate_up",))
        self.memory = mem = DeviceMemory(model, cfg)
        self.requests = Requests(model, cfg, self.sampler, mem.has_budget)
        self.templates = TemplateCache(model, cfg.planner, cfg.logits_kernel, cfg.attention, moe_kernel=cfg.moe_kernel,
                                       batch_invariant=cfg.batch_invariant, elementwise_kernel=cfg.elementwise_kernel)
        op_flops = CPU_OP_FLOPS if dev.type == "cpu" else None     # cancellation within ~1 s (policy/op_work.py)
        self.preparer = Preparer(self.templates, chunk_policy(cfg.chunks, mem.activation_limit, cfg.max_chunks,
                                                              cfg.min_attention_rows, op_flops),
                                 history_keep=HISTORY_KEEP)
        self.native_runner = NativeRunner(model)
        # captured steps replay a step's ~1,400 launches as one graph (runtime/graphs.py); under a
        # budget they capture into the guard's pool and are charged by admission (graph_charge.py)
        self.graphs = StepGraphs(CudaGraphs(dev), vocab=model.cfg.vocab, dtype=model.dtype) \
            if dev.type == "cuda" and cfg.cuda_graphs == "auto" and tp is None else None
        mem.attach_graphs(self.graphs)
        self.runner = PlannedRunner(model, mem.arena, sanitize=cfg.sanitize, logits_kernel=cfg.logits_kernel,
                                    attention=cfg.attention, elementwise_kernel=cfg.elementwise_kernel,
                                    before_step=mem.before_step, scope=mem.scope, on_step_done=mem.after_step,
                                    copier=mem.copier, host_pool=mem.host_pool, graphs=self.graphs,
                                    batch_invariant=cfg.batch_invariant, stream=mem.stream,
                                    moe_kernel=cfg.moe_kernel)
        # admission may run on a server's thread while a request runs on another: both go through
        # the one preparer (its caches), one at a time
        self.lock = threading.RLock()
        self.closed = False
        num_ranks = world()[1]
        agree = (lambda v: parallel.agree(v, dev)) if num_ranks > 1 else alone  # noqa: E731
        # tensor parallelism: every rank plans the same step over its heads (no sequence shards)
        shards = (lambda n: [None]) if tp is not None else (lambda n: [current(n, cfg.peer_rows, cfg.peer_overlap)])
        self.admitter = Admitter(model, cfg, self.preparer, mem.budget_for, self.requests.sampler_for,
                                 shards=shards, agree=agree,
                                 world=num_ranks, check_admitted=mem.check_host, lock=self.lock, graphs=self.graphs)
        self.executor = Executor(model, cfg, self.preparer, self.runner, self.native_runner, mem, self.lock)
        if dev.type == "cuda" and mem.has_budget and num_ranks == 1:
            mem.warm_up(self.warm_request, self.sampler)
        if cfg.max_length and not cfg.native and mem.has_budget:
            check_max_length(self, cfg.max_length)

    # -- read-only views of the parts (reports, tests, benchmarks)
    budget = property(lambda self: self.memory.budget, doc="the resident mode's Budget")
    offload_budget = property(lambda self: self.memory.offload_budget, doc="the offloaded modes' Budget")
    arena = property(lambda self: self.memory.arena, doc="the planned workspace")
    guard = property(lambda self: self.memory.guard, doc="the budget guard (None before a warm-up)")
    placement = property(lambda self: self.memory.placement, doc="where the layer weights live")
    warmup_report = property(lambda self: self.memory.warmup_report, doc="what the warm-up measured")

    @property
    def history(self):
        """StepStats of the last HISTORY_KEEP planned steps (policy/prepare.py)."""
        return self.preparer.history

    # -- requests
    def generation_config(self, config=None, **overrides) -> GenerationConfig:
        """Explicit arguments > generation_config.json > built-in defaults (HF convention)."""
        return self.requests.generation_config(config, **overrides)

    def sampler_for(self, gen: GenerationConfig):
        return self.requests.sampler_for(gen)

    def encode(self, prompt, chat: bool = False, tools=None,
               template: ChatOptions = DEFAULT_OPTIONS) -> list[list[int]]:
        return self.requests.encode(prompt, chat, tools, template)

    def decode(self, ids) -> str:
        return self.requests.decode(ids)

    def canvas(self, prompts: list[list[int]], gen_len: int, width: int | None = None) -> Canvas:
        return self.requests.canvas(prompts, gen_len, width)

    def pad_filler(self) -> int:
        """The id left padding is filled with (never the mask token)."""
        return pad_filler(self.model.cfg)

    def mask_ratio_config(self, gen, prompt_len: int, mask_ratio: float, cap: int | None = None):
        return self.requests.mask_ratio_config(gen, prompt_len, mask_ratio, cap)

    def lossy_options(self, offload=None) -> list[str]:
        """Engine options of the planned path that may change tokens (policy/features.py)."""
        return engine_labels(self.config, self.model, offload)

    def check(self, prompts: list[list[int]], gen: GenerationConfig, width: int | None = None) -> None:
        """Every argument error of a request of these prompts and options (InputError)."""
        self.requests.check(Request(tuple(tuple(p) for p in prompts), gen, self.sampler_for(gen), self.config.native,
                                    width))

    def request(self, prompt=None, max_new_tokens: int | None = None, **kw) -> Request:
        """The checked Request of generate()'s arguments (InputError before any work)."""
        return self.requests.build(prompt, max_new_tokens=max_new_tokens, **kw)

    # -- generation
    def generate(self, prompt=None, max_new_tokens: int | None = None, *, inputs=None, attention_mask=None,
                 steps=None, block_length=None, temperature=None, config=None, native: bool | None = None,
                 chat: bool = False, progress: bool | None = None, on_step=None, probe=None,
                 mask_ratio: float | None = None, cancelled=None, add_generation_prompt: bool | None = None,
                 continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                 **options) -> Generation:
        """Generate for one prompt or a batch.

        prompt (or inputs=, the HF name): text, token ids, chat messages, a list of those, or a
        [B, L] tensor of ids; attention_mask [B, L] (1 = token, 0 = left padding) with a padded
        tensor, as the official generate functions take it. A list of prompts is a batch of
        requests run together by the Scheduler (engine/scheduler.py): each prompt gets the tokens
        it gets alone (its own canvas, positions and random stream) and `Generation.parts` holds
        each one's result; a tensor (with or without attention_mask) is one left-padded request
        of B rows, as the references run a batch (one random stream over the batch; LLaDA's
        positions count the padding). seed=N draws from a private generator seeded N, every
        request of a list its own; without a seed the draws come from torch's default generator
        of the model's device, as the reference samplers' do (torch.manual_seed(s) before the
        call reproduces a reference run seeded s; the global state is never re-seeded; a list's
        requests each take a seed drawn from torch's default CPU generator). mask_ratio: the share
        of prompt + canvas that is generated, capped by an explicit max_new_tokens
        (mask_ratio_config), sized once for a list (its longest prompt). on_step(step_index,
        canvas [B, L]) is called after every denoising step (streaming; a list: per request, with
        that request's canvas [1, L_i]); if it returns True that request stops there
        (Generation.stopped_early), an exception it raises ends it with that error. cancelled()
        is checked before every forward (RequestCancelled). probe(ctx, op_name) after every op of
        the model (measurement only: it synchronises). Chat messages (and text with chat=True) go
        through the model's chat template; add_generation_prompt (default: True unless
        continue_final_message), continue_final_message (the last message, a partial assistant
        turn say, is left open and continued) and chat_template_kwargs (extra template variables)
        work as in transformers' apply_chat_template (chat_template.py).
        Raises InputError for bad arguments and MemoryBudgetError for a request over the budget,
        both before any work starts (every request of a list is admitted first); a list that
        fits only in part runs in waves (first come, first served)."""
        self.check_open()
        if progress is not None and not isinstance(progress, bool):
            raise InputError(f"progress must be True, False or None (the engine's setting), got {progress!r}")
        template = ChatOptions(add_generation_prompt, continue_final_message, chat_template_kwargs or {})
        request = self.requests.build(prompt, inputs=inputs, attention_mask=attention_mask, chat=chat,
                                      template=template, native=native, mask_ratio=mask_ratio, config=config,
                                      max_new_tokens=max_new_tokens, steps=steps, block_length=block_length,
                                      temperature=temperature, **options)
        given = inputs if inputs is not None else prompt
        separate = attention_mask is None and not isinstance(given, torch.Tensor) and world()[1] == 1
        requests = self.requests.split(request) if separate else [request]
        progress = self.config.progress if progress is None else progress
        runs = [self.start(r, on_step=on_step, probe=probe, cancelled=cancelled,
                           progress=progress and len(requests) == 1) for r in requests]
        return Scheduler(self).complete(runs, self.pad_filler(), progress=progress and len(runs) > 1)

    def start(self, request: Request, admission: Admission | None = None, **kw) -> RequestRun:
        """Admit `request` (planned path: refused before anything is allocated; `admission`: it
        was admitted already, e.g. by a server before queueing it) and return its RequestRun, not
        started: nothing is allocated until it runs (kw: on_step, probe, progress, cancelled)."""
        self.check_open()
        if admission is None and not request.native:
            admission = self.admit(request.batch, request.length, request.gen, constrained=request.grammar is not None)
        kind = BlockRun if request.sampler.block_diffusion else RequestRun
        return kind(request, self.executor, self.memory, self.requests, admission, **kw)

    def admit(self, batch: int, length: int, gen: GenerationConfig, constrained: bool = False) -> Admission:
        """Admit a request of `batch` sequences of `length` tokens or raise MemoryBudgetError
        (before anything is allocated) naming the longest of its shape that fits; constrained:
        it has an output constraint (its steps are charged: docs/STRUCTURED.md). Thread-safe."""
        self.check_open()
        return self.admitter.admit(batch, length, gen, constrained)

    def capacity(self, gen: GenerationConfig | None = None, batch: int = 1) -> int | None:
        """The longest prompt + max_new_tokens admitted, to the token, or None when nothing limits
        it (no budget, no max_length). gen None: the model's default options and the worst split
        of the length, a 1-token prompt and a canvas of the rest (a longer prompt with the same
        total masks fewer rows, so it is admitted too); gen given: its canvas fixed, the prompt
        growing (at least gen.max_new_tokens: nothing fits when that is the answer)."""
        self.check_open()
        limit = self.config.max_length
        if not self.memory.has_budget or self.config.native:
            return limit
        fixed = gen is not None
        gen = gen or self.generation_config()
        hi = limit or 1 << 21

        def gen_for(n: int) -> GenerationConfig:
            if fixed:
                return gen
            canvas = max(1, n - 1)
            block = None if gen.block_length is None else min(gen.block_length, canvas)
            return dataclasses.replace(gen, max_new_tokens=canvas, block_length=block)
        least = gen.max_new_tokens + 1 if fixed else 2
        if not limit:      # no max_length: double the search's ceiling while it still fits
            while hi < 1 << 36 and self.admitter.longest(batch, gen_for, hi, lo=hi, unit=1) == hi:
                hi *= 2
        best = self.admitter.longest(batch, gen_for, hi, lo=least, unit=1)
        return best if best else least - 1

    def warm_request(self, ids: list[int], gen_len: int, options: dict) -> None:
        """One planned request for the warm-up (no length warning, no progress bar)."""
        request = self.requests.build(ids, max_new_tokens=gen_len, steps=1, native=False, warn_length=False,
                                      **options)
        self.start(request).run()

    # -- one step (benchmarks, tests)
    def step(self, ids: torch.Tensor, *, native: bool = False, config=None, seed: int = 0, probe=None,
             offload: str | None = None):
        """One prediction of this model's sampler on canvas ids [B, L] with every masked position
        a candidate: (x0 [B, L] or [M], confidence), in offload mode `offload` (resident | weights
        | weights+kv; default the first mode the engine's offload option tries). probe(ctx, op)
        is called after every op."""
        self.check_open()
        gen = self.generation_config(config, max_new_tokens=1)
        g = torch.Generator(device=self.model.device).manual_seed(seed)
        off = offload_of(offload or candidates(self.config)[0], self.config, self.model.cfg)
        predict = self.sampler.predictor(gen, g, None, native)
        state = RowsState(offload=off, probe=probe)
        self.memory.place(None if native else off)
        try:
            return drive(self.sampler.one_step(predict, ids), lambda call: self.executor(call, state))
        finally:
            self.memory.end()

    def forward_logits(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       probe=None) -> torch.Tensor:
        """The native forward: logits [B, L, V] for ids [B, L] (attention_mask: 1 = token)."""
        self.check_open()
        valid = None if attention_mask is None else attention_mask.bool()
        self.memory.place(None)
        return self.native_runner.forward(ids, valid, probe)

    def kv_store(self, batch: int, length: int, admission: Admission | None = None):
        """A block cache's store for a request of batch x length tokens, laid out as `admission`
        chose (benchmarks; run.make_store)."""
        return make_store(self.model, self.config, batch, length, admission)

    # -- memory
    def memory_report(self, admission: Admission | None = None) -> dict:
        """Where the memory is (bytes): weights, arena, PyTorch's allocator, context, budget, the
        guard's cap, precision; admission: also what it predicted and its offload mode."""
        return reports.memory_report(self, admission)

    def memory_plot(self, prompts, gen: GenerationConfig, path: str) -> dict:
        """The first step of this request as a PNG (reports.memory_plot); returns the series."""
        return reports.memory_plot(self, prompts, gen, path)

    def peak_device_bytes(self) -> int:
        return self.memory.peak_device_bytes()

    def arena_extra_bytes(self, now: bool = False) -> int:
        return self.memory.arena_extra_bytes(now)

    def use_graphs(self, graphs) -> None:
        """Capture steps with `graphs` (a runtime.graphs.StepGraphs; the CPU tests' fake backend)
        from now on: the runner replays them, admission charges them, the guard hosts them."""
        self.graphs = self.runner.graphs = self.admitter.graphs = graphs
        self.memory.attach_graphs(graphs)

    def close(self) -> None:
        """Give back every byte the engine took: the graphs, the guard's pool and cap, the arena,
        the paged K/V pool, pinned host buffers, cached plans, and the weights when the engine
        loaded them. Calling it again does nothing; the engine refuses work after it (check_open)."""
        if self.closed:
            return
        self.closed = True
        with device_wide():       # never while another thread captures (memory/capture_guard.py)
            if self.graphs is not None:
                self.graphs.clear()
            self.memory.close()
            if self.executor.kv_pool is not None:
                self.executor.kv_pool.close()
            self.templates.clear()
            if self.owns_model:
                self.model.release()
            if self.model.device.type == "cuda":
                torch.cuda.empty_cache()

    def check_open(self) -> None:
        """InputError once close() ran (or a `with` block ended): its weights and arena are gone."""
        if self.closed:
            raise InputError(f"this engine is closed (close() ran, or its `with` block ended): its weights and "
                             f"memory were given back; build a new MosaicEngine({self.model.name!r}, ...) to generate")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
