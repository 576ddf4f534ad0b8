"""MosaicEngine: prompts in, tokens out, through the native or the planned path.

The facade composes the layers below it: a sampler object for the model's family (runtime/
samplers), the one prepare (policy/prepare.py) with its chunk policy, admission against the
budget (policy/admission.py), and the runners that execute a prepared step (runtime/runner.py)."""

from __future__ import annotations

import dataclasses
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from . import kernels
from .config import EngineConfig, GenerationConfig
from .config_file import is_config_path, load_engine_config
from .errors import InputError, MemoryBudgetError, gib
from .graph.shard import current, world
from .kernels.fp8 import cuda_fp8_error
from .loader import load
from .memory.accounting import FIXED_BYTES, Budget, context_bytes
from .memory.arena import make_arena
from .models import Model
from .models.precision import FP8_NAME, apply_precision, quantize_embedding, ranges
from .models.step import make_step
from .policy import timeline
from .policy.admission import Admission, admit, fit
from .policy.chunking import chunk_policy
from .policy.offload import candidates, host_available_bytes, mode_of, offload_of
from .policy.precision import plan_precision
from .policy.prepare import Preparer
from .policy.probe import probe_step
from .runtime import parallel
from .runtime.placement import WeightPlacement
from .runtime.runner import NativeRunner, PlannedRunner
from .runtime.samplers import sampler_for
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
    offload: str = "resident"     # resident | weights | weights+kv (policy/offload.py)
    precision: list[str] = field(default_factory=list)   # per layer weight dtype

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
        self.precision_report = self._apply_precision(cfg.precision)
        ctx_bytes = context_bytes(dev)
        self.budget = Budget.of(cfg.memory_budget, dev, model.weight_bytes(), context=ctx_bytes)
        # layers in host memory: only the embedding, LM head and norms stay charged
        self.offload_budget = Budget.of(cfg.memory_budget, dev, model.weight_bytes(layers=False), context=ctx_bytes)
        self.placement = WeightPlacement(model, dev)
        self.offload = offload_of(candidates(cfg)[0], cfg, model.cfg)   # this request's mode
        self.arena = make_arena(dev, cfg.arena)
        self.templates = TemplateCache(model, cfg.planner, cfg.logits_kernel, cfg.attention)
        limit = lambda step: self.budget_for(step.offload).activation_limit(step.batch, step.length)  # noqa: E731
        self.preparer = Preparer(self.templates, chunk_policy(cfg.chunks, limit, cfg.max_chunks,
                                                              cfg.min_attention_rows))
        self.native_runner = NativeRunner(model)
        self.runner = PlannedRunner(model, self.arena, sanitize=cfg.sanitize, logits_kernel=cfg.logits_kernel,
                                    attention=cfg.attention, on_step_done=self._trim_cache,
                                    elementwise_kernel=cfg.elementwise_kernel)
        self.last_admission: Admission | None = None

    def budget_for(self, offload) -> Budget:
        """The budget view of a mode: resident weights charged, or only the non-layer weights."""
        return self.budget if offload is None else self.offload_budget

    def _apply_precision(self, pc) -> dict | None:
        """Per-layer FP8 (config.precision): explicit ranges or chosen by sensitivity."""
        if pc is None:
            return None
        err = cuda_fp8_error(self.model.device)
        if err:
            raise InputError(err)
        rep = plan_precision(self.model, pc)
        apply_precision(self.model, rep["dtypes"])
        if pc.embed == FP8_NAME:
            quantize_embedding(self.model)
        rep["dtypes"] = list(self.model.precision)
        rep["ranges"] = ranges(self.model.precision)
        rep["weight_bytes"] = self.model.weight_bytes()
        return rep

    @property
    def history(self):
        """StepStats of every planned step run so far (policy/prepare.py)."""
        return self.preparer.history

    # -- request preparation
    def generation_config(self, config=None, **overrides) -> GenerationConfig:
        """Explicit arguments > generation_config.json > built-in defaults (HF convention)."""
        known = {f.name for f in dataclasses.fields(GenerationConfig)}
        merged = {ALIASES.get(k, k): v for k, v in self.model.generation_defaults.items()}
        merged = {k: v for k, v in merged.items() if k in known and v is not None}
        if config is not None:
            base = GenerationConfig.coerce(config)
            merged |= {f: getattr(base, f) for f in known if f != "extra"}
        unknown = sorted(set(overrides) - known - set(ALIASES))
        if unknown:
            raise InputError(f"unknown generation options {unknown}; known: {sorted(known)}")
        merged |= {ALIASES.get(k, k): v for k, v in overrides.items() if v is not None}
        return GenerationConfig(**merged)

    def encode(self, prompt, chat: bool = False) -> list[list[int]]:
        """Text, token ids, chat messages, or a list of those -> token id lists."""
        tok = self.model.tokenizer
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if isinstance(prompt, (str, dict)) or (isinstance(prompt, list) and prompt
                                                and isinstance(prompt[0], (int, dict))):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise InputError("prompt must be a string, a list of token ids, or a non-empty list of those")
        out = []
        for p in prompt:
            if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], dict)):
                if tok is None:
                    raise InputError(f"model {self.model.name} has no tokenizer.json: pass token ids")
                if chat or not isinstance(p, str):
                    msgs = [{"role": "user", "content": p}] if isinstance(p, str) else p
                    ids = tok.encode_chat(msgs)
                else:
                    ids = tok.encode(p)
            else:
                ids = [int(i) for i in p]
            if not ids:
                raise InputError("a prompt encodes to zero tokens")
            bad = [i for i in ids if not 0 <= i < self.model.cfg.vocab]
            if bad:
                raise InputError(f"token ids {bad[:8]} are outside the vocabulary [0, {self.model.cfg.vocab})")
            out.append(ids)
        return out

    def canvas(self, prompts: list[list[int]], gen_len: int) -> Canvas:
        """Left-padded prompts followed by gen_len mask ids, on the model's device."""
        cfg = self.model.cfg
        P = max(len(p) for p in prompts)
        pad = cfg.pad_id if cfg.pad_id is not None else cfg.eos_id
        x = torch.full((len(prompts), P + gen_len), cfg.mask_id, dtype=torch.long)
        valid = torch.ones_like(x, dtype=torch.bool)
        for i, p in enumerate(prompts):  # left padding
            x[i, : P - len(p)] = pad
            valid[i, : P - len(p)] = False
            x[i, P - len(p): P] = torch.tensor(p)
        dev = self.model.device
        return Canvas(x.to(dev), None if bool(valid.all()) else valid.to(dev), P)

    def check(self, prompts: list[list[int]], gen: GenerationConfig) -> None:
        """Every argument error before any work starts."""
        prompt_len = max(len(p) for p in prompts)
        self.sampler.check(gen, prompt_len)
        total = prompt_len + gen.max_new_tokens
        if world()[1] > 1 and self.model.cfg.family == "dream" and gen.temperature > 0:
            raise InputError("Dream sampling at temperature > 0 is not available across several "
                             "processes yet (its random draws depend on every rank's rows)")
        limit = self.config.max_length
        if self.config.offload in ("weights+kv", "auto") and world()[1] > 1:
            raise InputError("streamed K/V (offload: weights+kv or auto) is not available across several "
                             "processes yet; use offload: weights")
        if self.config.offload in ("weights+kv", "auto") and self.config.sparse is not None:
            raise InputError("block-sparse attention and streamed K/V (offload: weights+kv or auto) do "
                             "not combine yet")
        if self.config.sparse is not None and world()[1] > 1:
            raise InputError("block-sparse attention is not available across several processes yet")
        if limit and total > limit:
            raise InputError(f"prompt ({prompt_len} tokens) + max_new_tokens ({gen.max_new_tokens}) = "
                             f"{total} exceeds max_length {limit}")

    def admit(self, batch: int, length: int, gen: GenerationConfig) -> Admission:
        """Admit a request of `batch` sequences of `length` tokens or raise MemoryBudgetError
        (before anything is allocated) naming the longest that fits."""
        sampler, num_ranks = self.sampler, world()[1]

        def step_for(n: int, masked: int):
            return probe_step(self.model, n, masked, gen, batch=batch, cfg_pair=sampler.cfg_pair(gen),
                              shard=self._shard(n))
        sp = self.config.sparse   # its steps after the dense ones must fit too
        variants = (lambda s: s.with_(sparse=sp),) if sp is not None else ()
        masked = sampler.first_masked(gen) * batch
        modes = candidates(self.config)
        for mode in modes:   # auto: the least streaming that fits (policy/offload.py)
            off = offload_of(mode, self.config, self.model.cfg)
            mode_step = lambda n, m, off=off: step_for(n, m).with_(offload=off)  # noqa: E731
            budget = self.budget_for(off)
            if mode != modes[-1]:
                try:
                    prepared = fit(self.preparer, budget, mode_step(length, masked), variants)
                except MemoryBudgetError:
                    continue
                adm = Admission(prepared, budget.total(prepared.need_bytes, prepared.step.batch, length),
                                budget.budget_bytes)
            else:
                adm = admit(self.preparer, budget, mode_step, length, masked, min_length=num_ranks,
                            variants=variants)
            self._check_host(adm.prepared)
            self.offload, self.last_admission = off, adm
            return adm

    def _check_host(self, prepared) -> None:
        """Streamed K/V needs its host buffers (pinned) next to the offloaded layers: refuse
        before any work when the host cannot hold them (GPU only; on a CPU the budget is host)."""
        host = prepared.template.host_bytes
        if not host or self.model.device.type != "cuda":
            return
        have = host_available_bytes()
        held = self.runner.host_pool.nbytes + self.placement.host_bytes
        need = host + (0 if self.placement.offloaded else sum(self.model.layer_bytes()))
        if have is not None and need > have + held:
            raise MemoryBudgetError(f"streaming K/V from host memory needs {gib(need)} of host memory "
                                    f"(K and V of one sequence, and the offloaded layers); "
                                    f"{gib(have + held)} is available", needed_bytes=need, budget_bytes=have + held)

    def _shard(self, length: int):
        return current(length, self.config.peer_rows)

    # -- generation
    def generate(self, prompt, max_new_tokens: int | None = None, *, steps=None, block_length=None,
                 temperature=None, config=None, native: bool | None = None, chat: bool = False,
                 progress: bool | None = None, on_step=None, probe=None, **options) -> Generation:
        """Generate for one prompt or a batch (left-padded as the references do).

        on_step(step_index, canvas [B, L]) is called after every denoising step (streaming);
        probe(ctx, op_name) after every op of the model (measurement only: it synchronises).
        Raises InputError for bad arguments and MemoryBudgetError for a request over the budget,
        both before any work starts."""
        gen = self.generation_config(config, max_new_tokens=max_new_tokens, steps=steps,
                                     block_length=block_length, temperature=temperature, **options)
        prompts = self.encode(prompt, chat)
        self.check(prompts, gen)
        use_native = self.config.native if native is None else native
        if not use_native:  # refuse before anything is allocated on the device
            self.admit(len(prompts), max(len(p) for p in prompts) + gen.max_new_tokens, gen)
        x, valid, plen = self.canvas(prompts, gen.max_new_tokens)
        dev = self.model.device
        generator = torch.Generator(device=dev)
        generator.manual_seed(gen.seed if gen.seed is not None else torch.seed() % 2**63)
        total_steps = self.sampler.total_steps(gen)
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
        predict = self._predictor(gen, generator, valid, use_native, probe)
        self.sampler.run(predict, x, plen, gen, generator, after)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - t0
        if bar:
            bar.close()
        tokens = x[:, plen:].cpu()
        texts = [self.decode(t) for t in tokens]
        lossy = self.sampler.lossy_labels(gen, dev, use_native) + ([] if use_native else self.lossy_options())
        return Generation(texts, tokens, x.cpu(), "native" if use_native else "planned",
                          total_steps, seconds, self.peak_device_bytes(), gen, lossy,
                          "resident" if use_native else mode_of(self.offload), list(self.model.precision))

    def lossy_options(self) -> list[str]:
        """Engine options of the planned path that may change tokens relative to the reference."""
        cfg, out = self.config, []
        if cfg.attention != "sdpa":
            out.append(f"attention={cfg.attention}: its bf16 rounding may differ from PyTorch's SDPA order")
        if cfg.sparse is not None:
            rs = ", ".join(f"layers {r.layers[0]}-{r.layers[1]} {r.pattern}"
                           + (f" keep {r.keep:g}" if r.pattern == "topk" else "") for r in cfg.sparse.ranges)
            out.append(f"block-sparse attention after {cfg.sparse.dense_steps} dense steps ({rs})")
        if self.model.quantized:
            fp8 = ", ".join(str(a) if a == b else f"{a}-{b}" for (a, b) in
                            (r["layers"] for r in ranges(self.model.precision) if r["dtype"] == FP8_NAME))
            emb = " and the embedding (per-row scales)" if "embed_scale" in self.model.extra else ""
            out.append(f"FP8 weights in layers {fp8 or 'none'}{emb} (e4m3, per-channel weight scales, "
                       "per-token activation scales)")
        if self.offload is not None and self.offload.kv:
            out.append("K/V streamed from host memory: attention merged over key blocks in fp32 "
                       "(exact softmax; rounding differs from one SDPA call)")
        return out

    def _predictor(self, gen, generator, valid, native: bool, probe=None):
        if native:
            self.placement.ensure(False)       # the published forward reads device weights
            forward = lambda ids, v: self.native_runner.forward(ids, v, probe)  # noqa: E731
            return self.sampler.native_predict(forward, gen, generator, valid)
        return self.sampler.planned_predict(self._run_rows(valid, probe), gen, generator)

    def _run_rows(self, valid, probe=None):
        """run_rows for the planned predict functions: prepare, then execute (per rank). Counts
        the request's steps: block-sparse attention starts after the sparse config's dense_steps."""
        done = [0]

        def run(ids, rows, rows_u, reducer, positions=None):
            B, L = ids.shape
            v = valid if (rows_u is None or valid is None) else torch.cat([valid, valid])
            shard = self._shard(L)
            sp = self.config.sparse
            sparse = sp if sp is not None and done[0] >= sp.dense_steps else None
            done[0] += 1
            if shard is None:
                if rows.shape[0] == 0:
                    return {k: torch.empty(0, dtype=dt, device=ids.device)
                            for k, dt in reducer.outputs(self.model.dtype)}
                return self._execute(make_step(self.model.cfg, ids, v, rows=rows, rows_uncond=rows_u,
                                               reducer=reducer, sparse=sparse, offload=self.offload), probe)
            # this rank's slots only; every rank gets every slot's result back (all ranks run)
            pos = rows if positions is None else positions
            shift = self.model.cfg.logit_shift
            idx, local = parallel.localize(pos, L, B if rows_u is None else 2 * B, shard, shift)
            local_u = None if rows_u is None else parallel.localize(rows_u, L, 2 * B, shard, shift)[1]
            step = make_step(self.model.cfg, ids, v, rows=local, rows_uncond=local_u,
                             reducer=reducer.subset(idx), shard=shard, offload=self.offload)
            return parallel.gather_outs(self._execute(step, probe), idx, int(rows.shape[0]), shard)
        return run

    def _execute(self, step, probe=None):
        self.placement.ensure(step.offload is not None)   # layers where this mode reads them
        return self.runner.execute(step, self.preparer.prepare(step), probe)

    # -- one step (benchmarks, tests)
    def step(self, ids: torch.Tensor, *, native: bool = False, config=None, seed: int = 0, probe=None):
        """One prediction of this model's sampler on canvas ids [B, L] with every masked position
        a candidate: (x0 [B, L] or [M], confidence). probe(ctx, op) is called after every op."""
        gen = self.generation_config(config, max_new_tokens=1)
        g = torch.Generator(device=self.model.device).manual_seed(seed)
        return self.sampler.one_step(self._predictor(gen, g, None, native, probe), ids)

    def forward_logits(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       probe=None) -> torch.Tensor:
        """The native forward: logits [B, L, V] for ids [B, L] (attention_mask: 1 = token)."""
        valid = None if attention_mask is None else attention_mask.bool()
        self.placement.ensure(False)
        return self.native_runner.forward(ids, valid, probe)

    def decode(self, ids) -> str:
        """Token ids -> text, up to the first end-of-text, mask ids dropped."""
        tok = self.model.tokenizer
        cfg = self.model.cfg
        ids = [int(i) for i in ids]
        if cfg.eos_id in ids:  # the answer ends at the first end-of-text
            ids = ids[: ids.index(cfg.eos_id)]
        if tok is None:
            return " ".join(map(str, ids))
        return tok.decode([i for i in ids if i != cfg.mask_id])

    # -- memory
    def _trim_cache(self, prepared) -> None:
        """Under a budget, hand PyTorch's cached blocks back when they exceed what the plan
        expects outside the arena (the caching allocator keeps freed blocks reserved)."""
        dev = self.model.device
        if dev.type != "cuda" or self.budget.budget_bytes is None:
            return
        allowance = prepared.external_bytes + FIXED_BYTES + \
            (prepared.plan_bytes if self.arena.kind == "host" else 0)
        if torch.cuda.memory_reserved(dev) > allowance:
            torch.cuda.empty_cache()

    def memory_report(self) -> dict:
        """Where the device memory is: weights, arena, PyTorch's allocator, context, budget (bytes)."""
        dev = self.model.device
        adm = self.last_admission
        rep = {"device": str(dev), "weights_bytes": self.model.weight_bytes(),
               "arena": self.arena.kind, "arena_mapped_bytes": self.arena.mapped_bytes,
               "arena_peak_bytes": self.arena.peak_bytes, "budget_bytes": self.budget.budget_bytes,
               "last_prediction_bytes": adm.predicted_bytes if adm else None,
               "offload": mode_of(self.offload), "host_weights_bytes": self.placement.host_bytes,
               "host_kv_bytes": self.runner.host_pool.nbytes, "precision": self.precision_report}
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


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="denoising", unit="step", leave=False)
