"""What a model family is, as one record (docs/DESIGN.md "Where to change what": a new family is
one record). Everything below the execution layer that differs between families lives in its
`Family`: config.json parsing and writing, the fields it refuses, its special ids, its checkpoint
keys, its presets, its step-program traits, the names of its samplers, tensor-parallel support,
warm-up cases and its published calling convention. The rest of the engine reads the record
(`family_of(cfg)`), never a family name.

Samplers live above this layer (runtime/samplers/, the execution layer), so a record names them:
`Samplers("block_diffusion")`, and runtime/samplers/__init__.py maps each name to its class. A
family that samples as an existing one names that sampler and, for the block-diffusion sampler,
the published variant's knobs (`sampler_params`); a family with a new loop adds its sampler class
under that name in runtime/samplers/."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ...config import ModelConfig

Keys = dict[str, tuple[str, tuple[int, ...]]]     # canonical name -> (checkpoint key, shape)


@dataclass(frozen=True)
class Samplers:
    """The family's samplers by registered name (runtime/samplers/__init__.py REGISTRY): the
    published one, Fast-dLLM's accelerated variant (opt-in: a cache, threshold or factor) and
    the self-speculative variant (opt-in: speculate > 0); None: that variant does not exist
    (the exact sampler then refuses its options)."""
    exact: str
    fast: str | None = None
    speculative: str | None = None


@dataclass(frozen=True)
class Family:
    """One model family (module docstring).

    name: ModelConfig.family. display: its name in messages. model_types: config.json
    `model_type` values (lower case) it parses; claims(raw) -> bool decides between records
    sharing a model_type (LLaDA vs LLaDA-MoE). parse(raw) -> ModelConfig (after check_fields);
    to_hf(cfg) -> config.json (its inverse). refused / implemented: config.json fields
    (checkpoint_fields.py). weight_keys(cfg, tied) -> Keys. fused: checkpoint tensors loaded as
    one tensor whose row slices are views (leaf -> parts, widths by qkv_widths).
    padding: "keys" (left padding masked as keys only, positions count the pads: LLaDA) or
    "rows" (pad rows and columns masked, positions from the first real token: Dream).
    moe_block: "experts" (LLaDA-MoE: expert-id order) or "grouped" (LLaDA2: group-limited
    router, top-k order; models/moe_grouped.py). tensor_parallel: parallel: tensor supported.
    warmup_cases: sampling options that reach other kernels (engine/warmup.py).
    published_call: the published calling convention mosaic.compat serves for it
    ("llada.generate", "dream.diffusion_generate") or None. sampler_params: the published
    variant's knobs the exact sampler reads (block diffusion: runtime/samplers/block_diffusion.py).
    reads_generation_config: whether the published sampler takes its defaults from the
    checkpoint's generation_config.json (False: its sampling fields are left out, with a
    warning; its end-of-text ids still count). checkpoint_defaults(raw, folder) -> {option:
    value}: sampling defaults the family's published code takes from the checkpoint itself
    (its config.json, the generate() it ships: published_code.py), below generation_config.json."""
    name: str
    display: str
    model_types: tuple[str, ...]
    parse: Callable[[dict], ModelConfig]
    to_hf: Callable[[ModelConfig], dict]
    weight_keys: Callable[..., Keys]
    samplers: Samplers
    refused: Mapping = field(default_factory=dict)
    implemented: frozenset[str] = frozenset()
    claims: Callable[[dict], bool] | None = None
    presets: Mapping[str, ModelConfig] = field(default_factory=dict)
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    padding: str = "keys"
    moe_block: str = "experts"
    tensor_parallel: bool = False
    warmup_cases: tuple[Mapping, ...] = ()
    published_call: str | None = None
    sampler_params: Mapping = field(default_factory=dict)
    reads_generation_config: bool = True
    checkpoint_defaults: Callable[[dict, Path | None], dict] | None = None


def qkv_widths(cfg: ModelConfig) -> dict[str, int]:
    """Rows of each part of a fused q/k/v checkpoint tensor (and of its bias)."""
    return {"q": cfg.q_dim, "k": cfg.kv_dim, "v": cfg.kv_dim,
            "q_bias": cfg.q_dim, "k_bias": cfg.kv_dim, "v_bias": cfg.kv_dim}
