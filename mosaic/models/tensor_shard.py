"""Tensor parallelism, weight side: the per-rank model config, which slice of each checkpoint
tensor a rank holds, and the sharding of a model already in memory.

Layout (Megatron-style column/row split; graph/tensor.py holds the reduction):
  column-parallel (rows of the weight, dim 0): q, k, v (and their biases) by heads, gate and up
      by FFN columns;
  row-parallel (columns of the weight, dim 1): o by q heads, down by FFN columns; their outputs
      are partial sums, reduced once per block;
  experts (LLaDA-MoE): split whole across ranks, rank r holds experts [r E/K, (r+1) E/K) and runs
      the tokens routed to them; its sum over them is a partial sum, reduced as down's is;
  replicated: embedding, LM head, norms (q_norm/k_norm are per head over head_dim: replicated),
      the MoE router, RoPE tables; the o bias (iLLaDA) is kept by rank 0 only (zeros elsewhere),
      so that it is added once.
Rank r holds K/V heads [r Hkv/K, (r+1) Hkv/K) and the q heads [r Hq/K, (r+1) Hq/K) that read
them (q head i reads K/V head i // (Hq/Hkv): contiguous groups stay whole)."""

from __future__ import annotations

import dataclasses
import re

import torch

from ..config import ModelConfig
from ..errors import InputError
from ..graph.tensor import TensorShard
from . import allocate
from .families import FAMILIES, family_of

COLUMN = {"q": "q", "k": "kv", "v": "kv", "q_bias": "q", "k_bias": "kv", "v_bias": "kv",
          "gate": "ffn", "up": "ffn"}
ROW = {"o": "q", "down": "ffn"}
_LEAF = re.compile(r"^layers\.\d+\.(\w+?)(?:\.\d+)?$")
_EXPERT = re.compile(r"^layers\.\d+\.experts_\w+\.(\d+)$")


def check_divides(cfg: ModelConfig, world: int) -> None:
    """InputError (one message: what does not divide, what is allowed) unless the model's K/V
    heads and FFN width divide by the number of processes and the family is supported."""
    if not family_of(cfg).tensor_parallel:
        supported = ", ".join(n for n, f in FAMILIES.items() if f.tensor_parallel)
        raise InputError(f"tensor parallelism supports {supported}; {cfg.family} runs on one "
                         "process or with parallel: sequence")
    split = _split(cfg)
    bad = [f"{n} {what}" for n, what in split if n % world]
    if bad:
        ok = sorted(k for k in range(1, cfg.num_kv_heads + 1) if all(n % k == 0 for n, _ in split))
        what = "experts" if cfg.num_experts else "FFN columns"
        raise InputError(f"tensor parallelism over {world} processes splits the heads and {what} evenly, "
                         f"but the model has {' and '.join(bad)} (not divisible by {world}); use "
                         f"{' or '.join(map(str, ok))} processes (--gpus), or parallel: sequence")


def _split(cfg: ModelConfig) -> list[tuple[int, str]]:
    """What tensor parallelism divides: the heads, and the FFN columns or (MoE) the experts."""
    last = (cfg.num_experts, "experts") if cfg.num_experts else (cfg.ffn, "FFN columns")
    return [(cfg.num_kv_heads, "K/V heads"), (cfg.num_heads, "attention heads"), last]


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The config one rank's weights have: heads divided by world, and the FFN width (a MoE
    keeps its experts' width and E, its router's outputs: it holds experts(...) of them)."""
    check_divides(cfg, world)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                               ffn=cfg.ffn if cfg.num_experts else cfg.ffn // world)


def experts(cfg: ModelConfig, shard: TensorShard | None) -> tuple[int, int] | None:
    """[lo, hi) of the routed experts this rank holds (None: all of them, or not a MoE)."""
    if shard is None or not cfg.num_experts:
        return None
    return shard.part(cfg.num_experts)


def cut(canon: str, cfg: ModelConfig, shard: TensorShard) -> tuple[int, int, int] | None:
    """(dim, lo, hi) of the full checkpoint tensor `canon` (a canonical key: 'layers.3.q',
    'layers.0.experts_down.5') this rank holds, or None when it is replicated. cfg: the full
    model's config."""
    m = _LEAF.match(canon)
    leaf = m.group(1) if m else canon
    kind = COLUMN.get(leaf) or ROW.get(leaf)
    if kind is None:
        return None
    width = {"q": cfg.q_dim, "kv": cfg.kv_dim, "ffn": cfg.ffn}[kind]
    lo, hi = shard.part(width)     # head-aligned: q_dim, kv_dim are heads x head_dim
    if kind in ("q", "kv"):
        heads = cfg.num_heads if kind == "q" else cfg.num_kv_heads
        h0, h1 = shard.part(heads)
        lo, hi = h0 * cfg.head_dim, h1 * cfg.head_dim
    return (0 if leaf in COLUMN else 1), lo, hi


def holds(canon: str, held: tuple[int, int] | None) -> bool:
    """Whether a rank holding the routed experts `held` ([lo, hi), None: all) has a slot for the
    canonical key (every key but other ranks' experts)."""
    m = _EXPERT.match(canon)
    return held is None or m is None or held[0] <= int(m.group(1)) < held[1]


def take(t: torch.Tensor, where: tuple[int, int, int] | None) -> torch.Tensor:
    """The slice `cut` names of a full tensor (a view; the whole tensor when replicated)."""
    if where is None:
        return t
    dim, lo, hi = where
    return t.narrow(dim, lo, hi - lo)


def finish(model, shard: TensorShard) -> None:
    """After the slices are copied: rank > 0 zeroes its o bias (added once, by rank 0), and the
    model records its share."""
    if shard.rank > 0:
        for lw in model.layers:
            if "o_bias" in lw:
                lw["o_bias"].zero_()
    model.set_tensor(shard)


def check_share(model, rank: int, world: int) -> TensorShard | None:
    """model.tensor (None for a whole model) after checking it is this process's share: rank of
    world processes; InputError otherwise (a share run outside its process group)."""
    tp = model.tensor
    if tp is not None and (tp.rank, tp.world) != (rank, world):
        raise InputError(f"this model holds rank {tp.rank}'s share of {tp.world} (tensor parallelism), but this "
                         f"process is rank {rank} of {world}: load it inside its process group (one process per "
                         "share), or load the whole model")
    return tp


def full_tensors(model) -> dict[str, torch.Tensor]:
    """Canonical key -> tensor of a model in memory (the inverse of models.allocate's slots)."""
    out = {"embed": model.embed, "final_norm": model.final_norm}
    if model.lm_head is not model.embed:
        out["lm_head"] = model.lm_head
    for i, lw in enumerate(model.layers):
        for leaf, t in lw.items():
            if leaf.startswith("experts_"):   # a rank's share holds experts [lo, lo + held)
                lo = 0 if model.tensor is None else model.tensor.rank * t.shape[0]
                out |= {f"layers.{i}.{leaf}.{lo + j}": t[j] for j in range(t.shape[0])}
            elif not leaf.endswith("_scale"):
                out[f"layers.{i}.{leaf}"] = t
    return out


def shard_model(model, shard: TensorShard):
    """A new Model holding this rank's slices of `model`'s weights (copies: `model` is left as it
    is), for an engine given a Model in memory under tensor parallelism. Raises InputError as
    check_divides, and for a model already sharded, FP8 or offloaded."""
    if model.tensor is not None or model.quantized or model.packed_layers is not None:
        raise InputError("tensor parallelism shards a model with its 16/32-bit weights on the device: load "
                         "it again (not sharded, not FP8, not offloaded) and pass it to the engine")
    cfg = model.cfg
    tied = model.lm_head is model.embed
    part, _, slots = allocate(shard_config(cfg, shard.world), model.device, model.dtype, tied, name=model.name,
                              experts=experts(cfg, shard))
    part = dataclasses.replace(part, **{f: getattr(model, f) for f in ("tokenizer", "generation_defaults",
                                                                       "hf_config", "charged_layers")})
    full = full_tensors(model)
    for canon, t in slots.items():
        t.copy_(take(full[canon], cut(canon, cfg, shard)))
    finish(part, shard)
    return part

