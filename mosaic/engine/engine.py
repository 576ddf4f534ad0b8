"""MosaicEngine: prompts in, tokens out, through the native or the planned path."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import EngineConfig, GenerationConfig
from ..errors import InputError
from ..memory.arena import make_arena
from ..models import Model
from . import dream_sampler, llada_sampler
from .runners import NativeRunner, PlannedRunner

ALIASES = {"gen_length": "max_new_tokens"}


@dataclass
class Generation:
    texts: list[str]
    tokens: torch.Tensor          # [B, max_new_tokens] generated ids (on the CPU)
    sequences: torch.Tensor       # [B, prompt + max_new_tokens]
    path: str                     # "native" or "planned"
    steps: int
    seconds: float
    peak_device_bytes: int
    config: GenerationConfig
    lossy: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.texts[0]


class MosaicEngine:
    def __init__(self, model: Model | str | Path, config: EngineConfig | dict | None = None):
        from ..loader import load
        self.config = EngineConfig.coerce(config)
        if not isinstance(model, Model):
            model = load(model, self.config.device, self.config.dtype)
        self.model = model
        from ..memory.budget import charged_fixed, context_bytes
        self.fixed_bytes = charged_fixed(model.weight_bytes(), context_bytes(model.device))
        self.last_prediction = None
        self.native = NativeRunner(model)
        self.arena = make_arena(model.device, self.config.arena)
        from ..memory.chunking import make_chooser
        self.planned = PlannedRunner(model, self.config.planner, self.arena,
                                     chooser=make_chooser(self),
                                     sanitize=self.config.sanitize,
                                     logits_kernel=self.config.logits_kernel,
                                     attention=self.config.attention)
        self.planned.after_step = self._trim_cache

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

    def _canvas(self, prompts: list[list[int]], gen_len: int):
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
        return x.to(dev), (None if bool(valid.all()) else valid.to(dev)), P

    def check(self, prompts: list[list[int]], gen: GenerationConfig) -> None:
        """Every argument error before any work starts."""
        if self.model.cfg.family == "dream":
            dream_sampler.check(gen)
            if gen.cfg_scale:
                raise InputError("cfg_scale is a LLaDA sampler option; Dream has none")
        else:
            llada_sampler.check(gen, max(len(p) for p in prompts))
            dream_only = [k for k, v in (("alg", gen.alg != "maskgit_plus"), ("top_p", gen.top_p),
                                         ("top_k", gen.top_k), ("alg_temp", gen.alg_temp)) if v]
            if dream_only:
                raise InputError(f"{dream_only} are Dream sampler options; LLaDA samples with "
                                 "remasking, block_length, temperature and cfg_scale")
        total = max(len(p) for p in prompts) + gen.max_new_tokens
        from .parallel import current
        if current(total) is not None and self.model.cfg.family == "dream" and gen.temperature > 0:
            raise InputError("Dream sampling at temperature > 0 is not available across several "
                             "processes yet (its random draws depend on every rank's rows)")
        limit = self.config.max_length
        if limit and total > limit:
            raise InputError(f"prompt ({max(len(p) for p in prompts)} tokens) + max_new_tokens "
                             f"({gen.max_new_tokens}) = {total} exceeds max_length {limit}")

    # -- generation
    def generate(self, prompt, max_new_tokens: int | None = None, *, steps=None, block_length=None,
                 temperature=None, config=None, native: bool | None = None, chat: bool = False,
                 progress: bool | None = None, **options) -> Generation:
        gen = self.generation_config(config, max_new_tokens=max_new_tokens, steps=steps,
                                     block_length=block_length, temperature=temperature, **options)
        prompts = self.encode(prompt, chat)
        self.check(prompts, gen)
        use_native = self.config.native if native is None else native
        if not use_native:  # refuse before anything is allocated on the device
            self.admit((len(prompts), max(len(p) for p in prompts) + gen.max_new_tokens), gen)
        x, valid, plen = self._canvas(prompts, gen.max_new_tokens)
        cfg, dev = self.model.cfg, self.model.device
        generator = torch.Generator(device=dev)
        generator.manual_seed(gen.seed if gen.seed is not None else torch.seed() % 2**63)
        total_steps = (gen.steps or gen.max_new_tokens)
        bar = _progress(total_steps, self.config.progress if progress is None else progress)
        on_step = (lambda m: (bar.set_postfix(masked=m), bar.update(1))) if bar else None
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        if cfg.family == "dream":
            if use_native:
                pred = dream_sampler.native_predict(self.native.forward, gen, generator, valid)
            else:
                pred = dream_sampler.planned_predict(self._rows(valid), gen, generator)
            dream_sampler.generate(pred, x, gen, cfg, generator, on_step)
        else:
            if use_native:
                pred = llada_sampler.native_predict(self.native.forward, gen, cfg, generator, valid)
            else:
                pred = llada_sampler.planned_predict(self._rows(valid), gen, cfg, generator)
            llada_sampler.generate(pred, x, plen, gen, cfg, on_step)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - t0
        if bar:
            bar.close()
        tokens = x[:, plen:].cpu()
        texts = [self._decode(t) for t in tokens]
        lossy = self.lossy_labels(gen, use_native)
        return Generation(texts, tokens, x.cpu(), "native" if use_native else "planned",
                          total_steps, seconds, self.peak_device_bytes(), gen, lossy)

    def _rows(self, valid):
        from . import parallel

        def run(ids, rows, rows_u, reducer, positions=None):
            B, L = ids.shape
            shard = parallel.current(L)
            if shard is None:
                return self.planned.run_rows(ids, valid, rows, rows_u, reducer)
            # this rank's slots only; every rank gets every slot's result back
            pos = rows if positions is None else positions
            shift = self.model.cfg.logit_shift
            idx, local = parallel.localize(pos, L, B if rows_u is None else 2 * B, shard, shift)
            local_u = None if rows_u is None else parallel.localize(rows_u, L, 2 * B, shard, shift)[1]
            outs = self.planned.run_rows(ids, valid, local, local_u, reducer.subset(idx), shard)
            return parallel.gather_outs(outs, idx, int(rows.shape[0]), shard)
        return run

    def _decode(self, ids) -> str:
        tok = self.model.tokenizer
        cfg = self.model.cfg
        ids = [int(i) for i in ids]
        if cfg.eos_id in ids:  # the answer ends at the first end-of-text
            ids = ids[: ids.index(cfg.eos_id)]
        if tok is None:
            return " ".join(map(str, ids))
        return tok.decode([i for i in ids if i != cfg.mask_id])

    def lossy_labels(self, gen, native: bool) -> list[str]:
        """Options whose tokens may differ from the reference sampler's (named in the output)."""
        out = []
        if native:
            return out
        dev = self.model.device
        if gen.temperature > 0 and dev.type == "cuda":
            out.append("gumbel-stream: GPU random draws differ from the reference's stream")
        return out

    def admit(self, shape, gen) -> None:
        """Refuse a request that cannot fit the memory budget (memory/budget.py)."""
        from ..memory.budget import admit
        admit(self, shape, gen)

    def _trim_cache(self, tpl, plan) -> None:
        """Under a budget, hand PyTorch's cached blocks back when they exceed what the plan
        expects outside the arena (the caching allocator keeps freed blocks reserved)."""
        dev = self.model.device
        if dev.type != "cuda" or self.config.memory_budget is None:
            return
        from ..memory.budget import FIXED_BYTES
        allowance = tpl.external_peak() + FIXED_BYTES + (plan.total_bytes if self.arena.kind == "host" else 0)
        if torch.cuda.memory_reserved(dev) > allowance:
            torch.cuda.empty_cache()

    def memory_report(self) -> dict:
        """Where the device memory is: weights, arena, PyTorch's allocator, context, budget."""
        from ..memory.budget import budget_of, context_bytes
        dev = self.model.device
        rep = {"device": str(dev), "weights_bytes": self.model.weight_bytes(),
               "arena": self.arena.kind, "arena_mapped_bytes": self.arena.mapped_bytes,
               "arena_peak_bytes": self.arena.peak_bytes, "budget_bytes": budget_of(self),
               "last_prediction_bytes": self.last_prediction}
        if dev.type == "cuda":
            free, total = torch.cuda.mem_get_info(dev)
            rep |= {"torch_reserved_bytes": torch.cuda.memory_reserved(dev),
                    "torch_peak_reserved_bytes": torch.cuda.max_memory_reserved(dev),
                    "context_bytes": context_bytes(dev) - self.arena_extra_now(),
                    "device_used_bytes": total - free, "device_total_bytes": total}
        return rep

    def arena_extra_now(self) -> int:
        return getattr(self.arena, "physical_bytes", 0) if self.arena.kind == "vmm" else 0

    def peak_device_bytes(self) -> int:
        dev = self.model.device
        if dev.type == "cuda":
            return int(torch.cuda.max_memory_reserved(dev)) + self.arena_extra_bytes()
        import resource
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def arena_extra_bytes(self) -> int:
        """Arena bytes PyTorch's allocator does not count (the virtual-memory arena's pages)."""
        return self.arena.peak_bytes if getattr(self.arena, "kind", "") == "vmm" else 0


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="denoising", unit="step", leave=False)
