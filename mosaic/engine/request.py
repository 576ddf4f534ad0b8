"""A request, checked once: prompts in, a frozen `Request` out, or one InputError before any
work starts.

`Requests` holds what every request of one engine reads (the model, the engine options, the
family's sampler) and builds a `Request` from generate()'s arguments: the generation options
(explicit > generation_config.json > defaults, HF convention), the prompts as token ids (text,
chat messages, ids, a [B, L] tensor, or a left-padded batch with its attention mask), the
request's sampler, and every check: the sampler's options, the prompts, the features that do not
combine (policy/features.py), max_length and the host's memory. `canvas(request)` lays the
prompts out left-padded with the mask ids to fill."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import prompts as prompts_mod
from ..chat_template import DEFAULT_OPTIONS, ChatOptions
from ..cli_options import engine_options_advice
from ..config import SHARED_OPTIONS, EngineConfig, GenerationConfig
from ..config.structured import ConstraintSpec, spec_of, spec_of_response_format
from ..errors import InputError
from ..graph.shard import world
from ..loader import host_available_bytes
from ..policy.features import Setting, refuse
from ..runtime.grammar import Compiler
from ..runtime.samplers import Sampler, sampler_for
from .checks import SpeculationWarning, speculation_slower

ALIASES = {"gen_length": "max_new_tokens"}
CONSTRAINT_ARGS = ("json_schema", "regex", "choice", "grammar", "response_format", "constraint")


class Canvas(NamedTuple):
    """ids [B, P + G] (left-padded prompts then mask ids), valid [B, P + G] bool or None (no
    padding), prompt_len P."""
    ids: torch.Tensor
    valid: torch.Tensor | None
    prompt_len: int


@dataclass(frozen=True)
class Request:
    """One checked request: prompts (token ids, one tuple per sequence), its options, the
    caller's padded width (None: the longest prompt), the path and the sampler that runs it,
    and the length the model was trained for (None: unknown)."""
    prompts: tuple[tuple[int, ...], ...]
    gen: GenerationConfig
    sampler: Sampler
    native: bool = False
    width: int | None = None
    trained_length: int | None = None
    constraint: ConstraintSpec | None = None     # structured output (docs/STRUCTURED.md)
    grammar: object = None                       # its runtime.grammar.Grammar, compiled for this model

    @property
    def batch(self) -> int:
        return len(self.prompts)

    @property
    def prompt_len(self) -> int:
        """P: the longest prompt, or the caller's padded width."""
        return max(max(len(p) for p in self.prompts), self.width or 0)

    @property
    def length(self) -> int:
        """N = P + max_new_tokens: the sequence length of every step."""
        return self.prompt_len + self.gen.max_new_tokens

    @property
    def positions(self) -> int:
        """Positions the model runs: N, or for a block-diffusion canvas N rounded up to whole
        blocks (Sampler.positions)."""
        return self.sampler.positions(self.gen, self.prompt_len)

    @property
    def beyond_trained_length(self) -> bool:
        """Whether the request runs positions the model was not trained on (it runs; the answer
        may degrade): Generation.beyond_trained_length."""
        return self.trained_length is not None and self.positions > self.trained_length


def steps_within(gen: GenerationConfig, explicit: bool, sampler: Sampler) -> GenerationConfig:
    """A default `steps` (generation_config.json's) fitted to the request: rounded up to a
    multiple of the blocks (Sampler.steps_unit: the bundled models' 8 with gen_length 12 and
    block_length 4 runs 12, 4 per block, instead of being refused), then at most what `sampler`
    can use (Sampler.most_steps: one per new token for LLaDA, a multiple of the blocks, where a
    step past that commits nothing and greedy tokens are those of the capped run). The request's
    config, and so the stats and --json, carry the steps that run. Steps given by the caller are
    checked by the sampler instead (refused above what it can use or off the blocks)."""
    if explicit or not isinstance(gen.steps, int) or not isinstance(gen.max_new_tokens, int) or gen.steps < 1:
        return gen          # nothing to fit, or a value the sampler's check names
    unit = sampler.steps_unit(gen)
    steps = min(-(-gen.steps // unit) * unit, sampler.most_steps(gen))
    return gen if steps == gen.steps else dataclasses.replace(gen, steps=steps)


class Requests:
    """Builds the Requests of one engine (model, options, the family's sampler)."""

    def __init__(self, model, config: EngineConfig, sampler: Sampler, has_budget: bool):
        self.model, self.config, self.sampler = model, config, sampler
        self.has_budget = has_budget
        self.length_warned = False       # the trained-length warning is given once per engine
        self.speculation_warned = False  # so is the slower-speculation one (checks.speculation_slower)
        cfg = model.cfg
        self.compiler = Compiler(model.tokenizer, cfg.vocab, cfg.eos_id)   # structured output, per model

    # -- options
    def sampler_for(self, gen: GenerationConfig) -> Sampler:
        """The request's sampler: the family's, its self-speculative variant (speculate > 0) or
        its Fast-dLLM variant when `gen` asks for a cache, a threshold or a factor."""
        return sampler_for(self.model.cfg, gen) if gen.accelerated or gen.speculate else self.sampler

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
                          "not read: left out", UserWarning, stacklevel=4)
        if config is not None:
            base = GenerationConfig.coerce(config)
            merged |= {f: getattr(base, f) for f in known}
        unknown = sorted(set(overrides) - known - set(ALIASES))
        if unknown:
            advice = engine_options_advice({k: overrides[k] for k in unknown})
            raise InputError(f"unknown generation options {unknown}; {advice + '; ' if advice else ''}"
                             f"known generation options: {sorted(known)}")
        merged |= {ALIASES.get(k, k): v for k, v in overrides.items() if v is not None}
        explicit = overrides.get("steps") is not None or (config is not None and base.steps is not None)
        gen = GenerationConfig(**merged)
        return steps_within(gen, explicit, self.sampler_for(gen))

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

    # -- prompts
    def encode(self, prompt, chat: bool = False, tools=None,
               template: ChatOptions = DEFAULT_OPTIONS) -> list[list[int]]:
        """Text, token ids, chat messages, or a list of those -> token id lists (prompts.py);
        tools: function specs for a chat template that renders them; template: how chat
        messages are rendered (chat_template.ChatOptions)."""
        return prompts_mod.encode(self.model, prompt, chat, tools, template)

    def unpad(self, inputs, attention_mask) -> tuple[list[list[int]], int]:
        """Prompt id lists and the padded width from a left-padded batch and its attention mask."""
        return prompts_mod.unpad(self.model, inputs, attention_mask)

    def decode(self, ids) -> str:
        """Token ids -> text, up to the first end-of-text, mask ids dropped."""
        tok, cfg = self.model.tokenizer, self.model.cfg
        ids = [int(i) for i in ids]
        ends = [j for j, i in enumerate(ids) if i == cfg.eos_id or i in cfg.extra_eos_ids]
        if ends:  # the answer ends at the first end-of-text
            ids = ids[: ends[0]]
        if tok is None:
            return " ".join(map(str, ids))
        return tok.decode([i for i in ids if i != cfg.mask_id])

    def build(self, prompt=None, *, inputs=None, attention_mask=None, chat: bool = False, native: bool | None = None,
              mask_ratio: float | None = None, config=None, warn_length: bool = True,
              template: ChatOptions = DEFAULT_OPTIONS, **options) -> Request:
        """The Request of generate()'s arguments, every check made (InputError)."""
        if native is not None and not isinstance(native, bool):
            raise InputError(f"native must be True, False or None, got {native!r}")
        if inputs is not None and prompt is not None:
            raise InputError("pass the prompt once: as prompt or as inputs=, not both")
        prompt = inputs if inputs is not None else prompt
        if prompt is None:
            raise InputError("generate() needs a prompt (text, token ids, or inputs=[B, L] ids)")
        spec = self.constraint_spec({k: options.pop(k) for k in CONSTRAINT_ARGS if k in options})
        cap = options.get("max_new_tokens")
        gen = self.generation_config(config, **options)
        if attention_mask is not None:
            prompts, width = self.unpad(prompt, attention_mask)
        else:
            prompts, width = self.encode(prompt, chat, template=template), None
        if mask_ratio is not None:
            P = max(max(len(p) for p in prompts), width or 0)
            gen = self.mask_ratio_config(gen, P, mask_ratio, cap)
            gen = steps_within(gen, options.get("steps") is not None, self.sampler_for(gen))
        native = self.config.native if native is None else native
        request = Request(tuple(tuple(p) for p in prompts), gen, self.sampler_for(gen), native, width,
                          self.model.cfg.max_seq_len, spec)
        self.check(request, warn_length)
        if spec is not None:      # compiled last: every cheaper check first; cached per spec
            request = dataclasses.replace(request, grammar=self.compiler.compile(spec, gen.max_new_tokens))
        return request

    def split(self, request: Request) -> list[Request]:
        """A list of prompts as a batch of requests: one Request per prompt with the request's
        options (its canvas was sized once, for the longest prompt), each with its own random
        stream, keyed by the request and not by its row in a batch: the seed given, or, when the
        sampler draws and no seed was given, a seed drawn from torch's default CPU generator (so
        torch.manual_seed reproduces the batch)."""
        gen = request.gen
        if request.batch == 1:
            return [request]
        seeds = [gen.seed] * request.batch
        if gen.seed is None and request.sampler.draws(gen):
            seeds = [int(torch.randint(0, 2**63 - 1, ())) for _ in request.prompts]
        return [dataclasses.replace(request, prompts=(p,), gen=dataclasses.replace(gen, seed=s))
                for p, s in zip(request.prompts, seeds)]

    @staticmethod
    def constraint_spec(args: dict) -> ConstraintSpec | None:
        """The one output constraint among generate()'s json_schema / regex / choice / grammar /
        response_format / constraint (InputError when several are given)."""
        given = args.pop("constraint", None)     # a ConstraintSpec made by the caller (the server)
        fmt = spec_of_response_format(args.pop("response_format", None)) or given
        spec = spec_of(**args)
        if fmt is not None and spec is not None:
            raise InputError(f"give one output constraint, not response_format and {spec.name}")
        return fmt or spec

    def check(self, request: Request, warn_length: bool = True) -> None:
        """Every argument error before any work starts: the sampler's options (its check), then
        prompts, lengths and the features that do not combine. Warns once (LengthWarning) when
        the positions it runs exceed the length the model was trained for (prompt +
        max_new_tokens; a block-diffusion canvas rounded up to whole blocks)."""
        gen, sampler, P = request.gen, request.sampler, request.prompt_len
        sampler.check(gen, P)
        prompts_mod.check_prompts(self.model.cfg, [list(p) for p in request.prompts])
        refuse(self.setting(request))
        limit, total = self.config.max_length, request.positions
        rounded = prompts_mod.rounded_words(request.length, total)
        if limit and total > limit:
            raise InputError(f"prompt ({P} tokens) + max_new_tokens ({gen.max_new_tokens}) = "
                             f"{request.length}{rounded} exceeds max_length {limit}")
        self._check_host_memory(request.batch, total)
        if warn_length and total > self.model.cfg.max_seq_len and not self.length_warned:
            self.length_warned = True
            prompts_mod.warn_length(P, gen.max_new_tokens, self.model.cfg.max_seq_len, total)
        slower = speculation_slower(self.model.device.type, total, gen.speculate)
        if slower and warn_length and not self.speculation_warned:   # once per engine
            self.speculation_warned = True
            warnings.warn(slower, SpeculationWarning, stacklevel=4)

    def setting(self, request: Request) -> Setting:
        """What the request runs with, for the feature table (policy/features.py)."""
        gen, sampler = request.gen, request.sampler
        procs = world()[1]
        tp = self.model.tensor is not None     # tensor parallelism: no sequence shards
        return Setting(self.config, gen, self.model.cfg.family, request.native, 1 if tp else procs,
                       sampler.draws(gen), sampler.accelerated, sampler.uses_cache(gen), self.model.device.type,
                       sampler.block_diffusion, tensor=procs if tp else 1, coupled_draws=sampler.rank_coupled_draws,
                       constrained=request.constraint is not None)

    def _check_host_memory(self, batch: int, total: int) -> None:
        """Without a budget on the CPU, refuse a request whose smallest working set (the canvas,
        int64 ids, and x + K + V per token: the floor lazy chunking reaches) exceeds the memory the
        OS reports available, before anything is allocated: 10^11 new tokens used to fail inside
        torch.full with a raw RuntimeError (and an HTTP 500 through the server)."""
        if self.model.device.type != "cpu" or self.has_budget:
            return
        cfg, itemsize = self.model.cfg, self.model.dtype.itemsize
        per_token = 8 + (cfg.hidden + 2 * cfg.num_kv_heads * cfg.head_dim) * itemsize
        need, avail = batch * total * per_token, host_available_bytes()
        if avail is not None and need > avail:
            fits = avail // (batch * per_token)
            raise InputError(f"a request of {batch} x {total:,} tokens needs at least {need / 2**30:,.1f} GiB of "
                             f"host memory (canvas + x + K + V, {per_token} B per token); {avail / 2**30:.1f} GiB is "
                             f"available; at most ~{fits:,} tokens would fit")

    # -- the canvas
    def canvas(self, prompts, gen_len: int, width: int | None = None) -> Canvas:
        """Left-padded prompts (to `width`, default the longest) followed by gen_len mask ids,
        on the model's device. Padding positions hold a token that is never read (their keys are
        masked); LLaDA's positions count them, so `width` keeps a caller's padded width."""
        cfg = self.model.cfg
        P = max(max(len(p) for p in prompts), width or 0)
        pad = prompts_mod.pad_filler(cfg)
        x = torch.full((len(prompts), P + gen_len), cfg.mask_id, dtype=torch.long)
        valid = torch.ones_like(x, dtype=torch.bool)
        for i, p in enumerate(prompts):  # left padding
            x[i, : P - len(p)] = pad
            valid[i, : P - len(p)] = False
            x[i, P - len(p): P] = torch.tensor(p)
        dev = self.model.device
        return Canvas(x.to(dev), None if bool(valid.all()) else valid.to(dev), P)
