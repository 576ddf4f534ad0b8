"""Request preparation for the engine: generation options, prompts to a left-padded canvas, and
every argument check before any work starts (a mixin of engine.MosaicEngine)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import torch

from . import prompts as prompts_mod
from .config import SHARED_OPTIONS, GenerationConfig
from .errors import InputError
from .graph.shard import current, world
from .loader import host_available_bytes
from .models.precision import FP8_NAME, ranges
from .runtime.samplers import sampler_for

ALIASES = {"gen_length": "max_new_tokens"}


class Canvas(NamedTuple):
    """ids [B, P + G] (left-padded prompts then mask ids), valid [B, P + G] bool or None (no
    padding), prompt_len P."""
    ids: torch.Tensor
    valid: torch.Tensor | None
    prompt_len: int


class RequestsMixin:
    """Options, prompts, canvas and checks; the engine sets model, config and sampler."""

    def sampler_for(self, gen: GenerationConfig):
        """The sampler of this request: the family's, or its Fast-dLLM variant when `gen` asks
        for a cache, a threshold or a factor."""
        return sampler_for(self.model.cfg, gen) if gen.accelerated else self.sampler

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
        if foreign and not getattr(self, "_warned_foreign_defaults", False):   # once per engine
            self._warned_foreign_defaults = True
            warnings.warn(f"generation_config.json sets {foreign}, which the {self.sampler.display} sampler does "
                          "not read: left out", UserWarning, stacklevel=3)
        if config is not None:
            base = GenerationConfig.coerce(config)
            merged |= {f: getattr(base, f) for f in known}
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

    def check(self, prompts: list[list[int]], gen: GenerationConfig, width: int | None = None) -> None:
        """Every argument error before any work starts: the sampler's options (its check), then
        prompts, lengths and the engine options that do not combine with them (here). Warns once
        (LengthWarning) when prompt + max_new_tokens exceeds the length the model was trained for."""
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
        self._check_offload(gen)
        limit = self.config.max_length
        if self.config.sparse is not None and world()[1] > 1:
            raise InputError("block-sparse attention is not available across several processes yet")
        if limit and total > limit:
            raise InputError(f"prompt ({prompt_len} tokens) + max_new_tokens ({gen.max_new_tokens}) = "
                             f"{total} exceeds max_length {limit}")
        self._check_host_memory(len(prompts), total)
        if total > self.model.cfg.max_seq_len and not self._warned_length:
            self._warned_length = True
            prompts_mod.warn_length(prompt_len, gen.max_new_tokens, self.model.cfg.max_seq_len)

    def _check_host_memory(self, batch: int, total: int) -> None:
        """Without a budget on the CPU, refuse a request whose smallest working set (the canvas,
        int64 ids, and x + K + V per token: the floor lazy chunking reaches) exceeds the memory the
        OS reports available, before anything is allocated: 10^11 new tokens used to fail inside
        torch.full with a raw RuntimeError (and an HTTP 500 through the server)."""
        if self.model.device.type != "cpu" or self.budget.budget_bytes is not None:
            return
        cfg, itemsize = self.model.cfg, self.model.dtype.itemsize
        per_token = 8 + (cfg.hidden + 2 * cfg.num_kv_heads * cfg.head_dim) * itemsize
        need, avail = batch * total * per_token, host_available_bytes()
        if avail is not None and need > avail:
            fits = avail // (batch * per_token)
            raise InputError(f"a request of {batch} x {total:,} tokens needs at least {need / 2**30:,.1f} GiB of "
                             f"host memory (canvas + x + K + V, {per_token} B per token); {avail / 2**30:.1f} GiB is "
                             f"available; at most ~{fits:,} tokens would fit")

    def _check_offload(self, gen: GenerationConfig) -> None:
        """Offload modes that do not combine with other options yet (docs/OFFLOAD.md)."""
        off = self.config.offload
        if off in ("weights+kv", "auto") and world()[1] > 1:
            raise InputError("streamed K/V (offload: weights+kv or auto) is not available across several "
                             "processes yet; use offload: weights")
        if off in ("weights+kv", "auto") and self.config.sparse is not None:
            raise InputError("block-sparse attention and streamed K/V (offload: weights+kv or auto) do "
                             "not combine yet")
        if off == "weights+kv" and gen.cache != "none":
            raise InputError("a block cache (cache 'prefix'/'dual') keeps its K/V in its own store (kv_tier "
                             "places them on the device or the host); with it use offload: weights or auto")

    def lossy_options(self, offload=None) -> list[str]:
        """Engine options of the planned path that may change tokens relative to the reference
        (offload: the request's graph.streams.Offload; streamed K/V changes the rounding)."""
        cfg, out = self.config, []
        if cfg.attention != "sdpa":
            out.append(f"attention={cfg.attention}: its bf16 rounding may differ from PyTorch's SDPA order")
        if cfg.sparse is not None:
            rs = ", ".join(f"layers {r.layers[0]}-{r.layers[1]} {r.pattern}"
                           + (f" keep {r.keep:g}" if r.pattern == "topk" else "") for r in cfg.sparse.ranges)
            out.append(f"block-sparse attention after {cfg.sparse.dense_steps} dense steps ({rs}; "
                       f"{cfg.sparse.estimate} block estimate)")
        if self.model.quantized:
            fp8 = ", ".join(str(a) if a == b else f"{a}-{b}" for (a, b) in
                            (r["layers"] for r in ranges(self.model.precision) if r["dtype"] == FP8_NAME))
            emb = " and the embedding (per-row scales)" if "embed_scale" in self.model.extra else ""
            out.append(f"FP8 weights in layers {fp8 or 'none'}{emb} (e4m3, per-channel weight scales, "
                       "per-token activation scales)")
        if offload is not None and offload.kv:
            out.append("K/V streamed from host memory: attention merged over key blocks in fp32 "
                       "(exact softmax; rounding differs from one SDPA call)")
        return out

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

    def _shard(self, length: int):
        return current(length, self.config.peer_rows, self.config.peer_overlap)
