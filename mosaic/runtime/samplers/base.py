"""What every sampler is: the object that owns a family's denoising loop and options.

A sampler validates its options (refusing another family's), runs the published loop, and gives
`predict` functions on two paths: the reference path (full logits from the native forward) and
the planned path (per-masked-row reductions from `run_rows`). Adding a sampler (an accelerated
variant, say) means one new subclass here and its name in samplers/__init__.py."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...config import GENERATION_DEFAULTS, OPTIONS, SHARED_OPTIONS, GenerationConfig
from ...errors import InputError
from ..ties import row_starts

# run_rows(ids [B', L], rows [M] int64, rows_uncond [M] | None, reducer, positions=None)
#   -> {"x0": [M] int64, "conf": [M]}: runs the planned step program on the given masked rows
RunRows = Callable[..., dict]
# forward(ids [B, L], valid [B, L] | None) -> logits [B, L, V]: the native forward
Forward = Callable[..., torch.Tensor]


class Sampler:
    """Base of the family samplers. Subclasses set `family`, `options` (the GenerationConfig
    fields they read besides the shared ones) and implement the methods below."""
    family = ""
    display = ""                      # the family's name in messages
    options: frozenset = frozenset()

    def __init__(self, mcfg):
        self.mcfg = mcfg

    def check(self, gen: GenerationConfig, prompt_len: int) -> None:
        """Raise InputError for an option this sampler does not read (set away from its default)
        or a value it cannot use, before any work starts."""
        own = sorted(SHARED_OPTIONS | self.options)
        for name in own:    # types and least values, as each option declares them (config/generation.py)
            OPTIONS[name].check(name, getattr(gen, name))
        foreign = [n for n in OPTIONS if n not in SHARED_OPTIONS | self.options
                   and getattr(gen, n) != getattr(GENERATION_DEFAULTS, n)]
        if foreign:
            names = foreign
            owner = OPTIONS[foreign[0]].sampler or "another"
            what = f"{names[0]} is a {owner} sampler option" if len(names) == 1 else \
                f"{', '.join(names)} are {owner} sampler options"
            raise InputError(f"{what}; {owner} sampler options do not apply to a {self.display} model "
                             f"(its sampler reads {', '.join(own)})")
        if gen.seed is not None and not 0 <= gen.seed < 2**64:
            raise InputError(f"seed must be in [0, 2**64), got {gen.seed}")
        self.check_own(gen, prompt_len)

    def check_own(self, gen: GenerationConfig, prompt_len: int) -> None:
        """The family's own value checks."""

    def total_steps(self, gen: GenerationConfig) -> int:
        return gen.steps or gen.max_new_tokens

    def first_masked(self, gen: GenerationConfig) -> int:
        """Masked rows per sequence of the first step's logits (the most the request will have)."""
        return gen.max_new_tokens

    def cfg_pair(self, gen: GenerationConfig) -> bool:
        """Whether each step runs a second, unconditional copy of the batch."""
        return False

    def native_predict(self, forward: Forward, gen, generator, valid):
        raise NotImplementedError

    def planned_predict(self, run_rows: RunRows, gen, generator):
        raise NotImplementedError

    def run(self, predict, x: torch.Tensor, prompt_len: int, gen, generator, on_step=None) -> torch.Tensor:
        """The denoising loop on canvas x [B, prompt_len + max_new_tokens], in place."""
        raise NotImplementedError

    def one_step(self, predict, x: torch.Tensor):
        """One prediction over every masked position of canvas x (benchmarks: a step's cost)."""
        raise NotImplementedError

    def lossy_labels(self, gen, device: torch.device, native: bool) -> list[str]:
        """Ways this run's tokens may differ from the reference sampler's (named in the output)."""
        return []



def with_starts(predict, valid: torch.Tensor | None, dtype: torch.dtype | None):
    """predict, carrying the first real token of each row of the request's canvas (valid [B, L]
    bool, False = left padding) for the loop's tie-breaking in a model of `dtype` (None where
    ties break as published: runtime/ties.py). The native predict functions set it when they
    see the logits' dtype, so the loops read it after each call."""
    predict.row_starts = row_starts(valid, dtype)
    return predict


def starts_of(predict) -> list[int] | None:
    """The row starts a predict function carries (None: no row is padded)."""
    return getattr(predict, "row_starts", None)
