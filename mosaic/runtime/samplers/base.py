"""What every sampler is: the object that owns a family's denoising loop and options, and declares
every member the engine uses.

A sampler validates its options (refusing another family's), and runs the published loop as a
coroutine (`loop`): each model evaluation it needs is *yielded* as a call, the driver (the
engine's RequestRun, or a scheduler that batches several requests) executes it and sends the
outputs back, and after each denoising step it yields a `StepDone`. So the loop never calls the
engine and holds no engine state: many loops can be suspended at once, each at its pending call.

  RowsCall   the planned path: the step program over the masked rows only -> {"x0": [M] int64,
             "conf": [M]} (runtime/reducers.py reduces the logits row by row)
  LogitsCall the reference path: the native forward -> logits [B, L, V]
  StepDone   one denoising step finished (masked: the candidates it had); the driver sends None

`loop` returns the run's statistics (a dict; Fast-dLLM: `row_nfe`, the forwards each row would
take alone). Adding a sampler (an accelerated variant, say) means one new subclass here and its
name in samplers/__init__.py."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from ...config import GENERATION_DEFAULTS, OPTIONS, SHARED_OPTIONS, GenerationConfig
from ...errors import InputError
from ..reducers import LLaDAReducer
from ..ties import row_starts


@dataclass(frozen=True)
class RowsCall:
    """A planned step over canvas ids [B', L] that predicts the masked rows `rows` [M] (flat
    indices into B' x L; rows_uncond [M] for cfg's unconditional copy), reduced by `reducer`;
    positions [M]: the canvas slots the rows predict (Dream reads row j-1 for slot j); cache: a
    models.kv_cache.CacheStep (a block cache's fill or block step) or None; canvas_rows [B']:
    the request's row each canvas of ids belongs to (its padding; self-speculative verification
    runs several canvases per row), None: ids are the request's rows."""
    ids: torch.Tensor
    rows: torch.Tensor
    rows_uncond: torch.Tensor | None
    reducer: object
    positions: torch.Tensor | None = None
    cache: object = None
    canvas_rows: torch.Tensor | None = None


@dataclass(frozen=True)
class LogitsCall:
    """The native forward of ids [B, L] (valid [B, L] bool, or None without padding)."""
    ids: torch.Tensor
    valid: torch.Tensor | None


@dataclass(frozen=True)
class BlockCall:
    """A block-diffusion step (runtime/samplers/block_diffusion.py): canvas columns [a, hi) of
    the request's block canvas run against its block K/V store; rows [M] flat over the
    B x (hi - a) rows that run, reduced by `reducer`."""
    a: int
    hi: int
    rows: torch.Tensor
    reducer: object


@dataclass(frozen=True)
class StepDone:
    """One denoising step is done; `masked` candidates it had (progress bars, streams)."""
    masked: int


Call = RowsCall | LogitsCall
Loop = Generator  # Generator[Call | StepDone, dict | torch.Tensor | None, dict]
# execute(call) -> the call's outputs; on_step(masked) after every denoising step
Execute = Callable[[Call], object]


def evaluate(result):
    """`yield from evaluate(predict(...))`: a predict that is a generator (it yields calls) runs
    by delegation; a plain function's result is taken as it is (tests drive loops with them)."""
    if inspect.isgenerator(result):
        return (yield from result)
    return result


def drive(loop: Loop, execute: Execute | None = None, on_step=None):
    """Run a sampler coroutine to its end: execute each call it yields, report each StepDone to
    on_step(masked); returns the loop's statistics."""
    try:
        event = next(loop)
        while True:
            if isinstance(event, StepDone):
                if on_step is not None:
                    on_step(event.masked)
                event = loop.send(None)
            else:
                event = loop.send(execute(event))
    except StopIteration as stop:
        return stop.value if stop.value is not None else {}


class Sampler:
    """Base of the family samplers. Subclasses set `family`, `display`, `options` (the
    GenerationConfig fields they read besides the shared ones) and implement `loop`,
    `native_predict` and `planned_predict`; everything else has a default here."""
    family = ""
    display = ""                      # the family's name in messages
    options: frozenset = frozenset()
    accelerated = False               # a Fast-dLLM variant: planned path only, lossy, no one_step
    block_diffusion = False           # its loop runs over a block canvas (loop_blocks): LLaDA2.x
    rank_coupled_draws = False        # its random draws read every rank's rows (Dream)

    def __init__(self, mcfg):
        self.mcfg = mcfg

    # -- options
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
        most = self.most_steps(gen)
        if gen.steps is not None and gen.steps > most:
            raise InputError(f"steps {gen.steps} is more than the {self.display} sampler can use with max_new_tokens "
                             f"{gen.max_new_tokens}: at most {most} ({self.steps_reason})", param="steps")
        self.check_own(gen, prompt_len)

    steps_reason = "a step commits at least one token; further steps would cost a forward each and change nothing"

    def most_steps(self, gen: GenerationConfig) -> int:
        """The most denoising steps this sampler can use (steps above are refused): one per new
        token. (The schedule the loop keeps is [B, steps] int64, so at most 8 bytes per canvas
        token: inside the per-token input bytes admission charges, memory/accounting.py.)"""
        return gen.max_new_tokens

    def steps_unit(self, gen: GenerationConfig) -> int:
        """What `steps` must be a multiple of: the number of blocks where each block runs
        steps / blocks steps (LLaDA), else 1. A default steps (generation_config.json's) is
        rounded up to it (engine/request.steps_within); a caller's steps that is not is refused."""
        return 1

    def check_own(self, gen: GenerationConfig, prompt_len: int) -> None:
        """The family's own value checks."""

    # -- what admission and the driver need to know
    def total_steps(self, gen: GenerationConfig) -> int:
        return gen.steps or gen.max_new_tokens

    def max_steps(self, gen: GenerationConfig) -> int:
        """The most denoising steps a request can take (the progress bar's total)."""
        return self.total_steps(gen)

    def positions(self, gen: GenerationConfig, prompt_len: int) -> int:
        """Positions a sequence of a prompt_len-token prompt runs through the model: prompt +
        max_new_tokens (a block-diffusion canvas rounds that up to whole blocks). What the
        trained length and max_length are checked against."""
        return prompt_len + gen.max_new_tokens

    def first_masked(self, gen: GenerationConfig) -> int:
        """Masked rows per sequence of the first step's logits (the most the request will have)."""
        return gen.max_new_tokens

    def admit_rows(self, gen: GenerationConfig, length: int) -> int:
        """Masked rows per sequence of the largest step of a request of `length` tokens."""
        return self.first_masked(gen)

    def constrained_rows(self, gen: GenerationConfig, length: int) -> int:
        """Masked rows per sequence of the largest step under an output constraint (its window:
        samplers/constraint.py); by default the unconstrained step's (an upper bound)."""
        return self.admit_rows(gen, length)

    def canvases(self, gen: GenerationConfig) -> int:
        """Canvases per sequence of the largest step (self-speculative verification runs several)."""
        return 1

    def cfg_pair(self, gen: GenerationConfig) -> bool:
        """Whether each step runs a second, unconditional copy of the batch."""
        return False

    def uses_cache(self, gen: GenerationConfig) -> bool:
        """Whether the request keeps a block K/V store across steps (Fast-dLLM prefix/dual)."""
        return False

    def draws(self, gen: GenerationConfig) -> bool:
        """Whether the loop draws random numbers (sampling, random remasking, origin's draws)."""
        return gen.temperature > 0

    def lossy_labels(self, gen, device: torch.device, native: bool) -> list[str]:
        """Ways this run's tokens may differ from the reference sampler's (named in the output)."""
        return []

    def probe_reducer(self, gen: GenerationConfig, total_rows: int, device: torch.device):
        """The reducer a meta-tensor probe step of `total_rows` canvas rows plans with
        (policy/probe.py): the one whose buffers this sampler's steps allocate."""
        return LLaDAReducer(self.mcfg, gen, [], total_rows, None, device)

    # -- the loop
    def predictor(self, gen, generator, valid, native: bool, dtype: torch.dtype | None = None, constraint=None):
        """The predict function the loop calls on this path (a generator: it yields calls),
        carrying the first real token of each row of the canvas (valid [B, L], False = left
        padding) for the loop's tie-breaking in a model of `dtype` (runtime/ties.py: from the
        row's first token in bfloat16 / float16, as published otherwise), and the request's
        output constraint (runtime/constraint.py; its reducer wraps the planned calls)."""
        predict = self.native_predict(gen, generator, valid) if native else self.planned_predict(gen, generator)
        if constraint is not None:
            predict = constraint.wrap(predict)
        return Predict(predict, row_starts(valid, dtype), constraint)

    def native_predict(self, gen, generator, valid):
        raise NotImplementedError

    def planned_predict(self, gen, generator):
        raise NotImplementedError

    def loop(self, predict, x: torch.Tensor, prompt_len: int, gen, generator) -> Loop:
        """The denoising loop on canvas x [B, prompt_len + max_new_tokens], in place, as a
        coroutine (module docstring); returns its statistics."""
        raise NotImplementedError

    def run(self, predict, x: torch.Tensor, prompt_len: int, gen, generator, on_step=None,
            execute: Execute | None = None) -> torch.Tensor:
        """The loop run to its end (execute: runs the calls a generator predict yields); x."""
        drive(self.loop(predict, x, prompt_len, gen, generator), execute, on_step)
        return x

    def one_step(self, predict, x: torch.Tensor) -> Loop:
        """One prediction over every masked position of canvas x (benchmarks: a step's cost), as
        a coroutine returning (x0, confidence)."""
        raise NotImplementedError


class Predict:
    """A predict function with the row starts of its canvas: per row the index of its first real
    token, or None (runtime/ties.py), and the request's output constraint (None: free text);
    calling it calls the function."""

    def __init__(self, fn, row_starts: list[int] | None, constraint=None):
        self.fn, self.row_starts, self.constraint = fn, row_starts, constraint

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def starts_of(predict) -> list[int] | None:
    """The row starts a predict function carries (None: no row is ranked from its start)."""
    return getattr(predict, "row_starts", None)
