"""Steps on meta tensors (no memory, no data): what planning, admission and capacity look at."""

from __future__ import annotations

import dataclasses

import torch

from ..config import GenerationConfig
from ..graph.shard import PEER_ROWS, Shard
from ..models.step import Step, make_step
from ..runtime.samplers import sampler_for
from ..runtime.samplers.constrained_reducer import ConstrainedReducer

META = torch.device("meta")


def probe_step(model, n_tokens: int, n_masked: int, gen: GenerationConfig | None = None,
               batch: int = 1, world: int = 1, cfg_pair: bool = False, shard: Shard | None = None,
               rank: int = 0, constrained: bool = False, accelerated: bool = False) -> Step:
    """A step of `batch` sequences of n_tokens with n_masked masked slots in all, on meta tensors.

    world > 1: rank `rank`'s share under sequence parallelism (rank 0 holds the largest slice);
    shard: this process's own share instead. A rank may own every masked slot (the canvas sits at
    the end of the sequence), so its masked rows are min(n_masked, rows it holds): the capacity
    planner and run-time admission plan the same worst case, and every rank chooses its chunk
    counts from the same masked total. cfg_pair: LLaDA's classifier-free guidance runs the batch
    twice (conditional + unconditional rows). constrained: the step of an output constraint (the
    family reducer wrapped as runtime/samplers/constrained_reducer.py runs it: the buffer path,
    the window's logits saved, the walk's bytes after the step); accelerated: a Fast-dLLM
    sampler's step (LLaDA's confidences in float64, as fast_llada.py reduces them).
    Raises InputError when n_tokens < world."""
    gen = gen or GenerationConfig()
    ids = torch.empty(batch * (2 if cfg_pair else 1), n_tokens, dtype=torch.long, device=META)
    if shard is None and world > 1:
        shard = Shard.of(n_tokens, rank, world, piece_rows=PEER_ROWS)
    total = None
    if shard is not None:
        total = max(1, n_masked)
        n_masked = min(n_masked, batch * shard.rows)
    rows = torch.empty(max(1, n_masked), dtype=torch.long, device=META)
    g = dataclasses.replace(gen, confidence_dtype="float64") if constrained and accelerated else gen
    reducer = sampler_for(model.cfg).probe_reducer(g, ids.shape[0] * n_tokens, META)
    if constrained:
        reducer = ConstrainedReducer(reducer, None, rows, n_tokens, model.cfg.vocab, cfg_pair)
    return make_step(model.cfg, ids, None, rows=rows, rows_uncond=rows if cfg_pair else None,
                     reducer=reducer, shard=shard, masked_total=total)


def request_step(model, sampler, batch: int, length: int, gen: GenerationConfig,
                 shard: Shard | None = None) -> Step:
    """The first step of a request of `batch` x `length` tokens: the most masked rows it will
    ever have (the sampler says how many), on meta tensors."""
    return probe_step(model, length, sampler.first_masked(gen) * batch, gen, batch=batch,
                      cfg_pair=sampler.cfg_pair(gen), shard=shard)
