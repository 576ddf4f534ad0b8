"""One request's sampling options (GenerationConfig), each declared once.

Every field carries an `Option` in its metadata: its type, the sampler that reads it (None:
every sampler), its help text, allowed choices and least value, and its command-line flags. The
samplers' type checks (runtime/samplers/base.py), the CLI's sampling flags (cli_args.py) and the
server's request fields (serve/protocol.py) are all derived from these declarations, so an option
is added in one place."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields

from ..errors import InputError
from .values import coerce

CACHE_CHOICES = ("none", "prefix", "dual")     # Fast-dLLM block caches
LLADA, DREAM, FAST, SPEC = "LLaDA", "Dream", "Fast-dLLM", "self-speculative"
BLOCK = "block-diffusion"                      # LLaDA2.x (2.1: token editing), SDAR
_WHAT = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}


@dataclass(frozen=True)
class Option:
    """How one GenerationConfig field is read and checked.

    kind: the Python type (int, float, str, bool); optional: None allowed (unset); sampler: the
    family whose sampler reads it (LLaDA, Dream, Fast-dLLM) or None for every sampler; least:
    the smallest value allowed (numbers); choices: the allowed strings; flags: command-line
    flags (default --name-with-dashes; () keeps it off the CLI); cli_default: the CLI's own
    default where it differs from 'unset' (the seed: runs repeat)."""
    kind: type
    help: str
    optional: bool = False
    sampler: str | None = None
    least: float | None = None
    choices: tuple[str, ...] | None = None
    flags: tuple[str, ...] | None = None
    cli_default: object = None

    def check(self, name: str, value) -> None:
        """InputError when value has the wrong type or lies below `least`."""
        if value is None and self.optional:
            return
        want = self.kind
        ok = isinstance(value, want) if want in (str, bool) else \
            isinstance(value, (int, float) if want is float else int) and not isinstance(value, bool)
        if ok and want is float and not math.isfinite(value):
            ok = False
        if not ok:
            raise InputError(f"{name} must be {_WHAT[want]}{' or unset' if self.optional else ''}, got {value!r}",
                             param=name)
        if self.least is not None and value < self.least:
            what = "positive" if self.least == 1 and want is int else f">= {self.least:g}"
            raise InputError(f"{name} must be {what}, got {value}", param=name)


def option(default, kind: type, help: str, **kw):
    """A dataclass field declared with its Option (see Option for the keywords)."""
    opt = Option(kind, help, **kw)
    return field(default=default, metadata={"option": opt, "sampler": opt.sampler})


@dataclass(frozen=True)
class GenerationConfig:
    """One request's sampling options (HF convention: explicit > generation_config.json > these).

    Shared: max_new_tokens (LLaDA's gen_length), steps (default generation_config.json's fitted to the
    blocks, else max_new_tokens), temperature,
    seed. The other fields belong to one family's sampler (their Option says which); a sampler
    refuses another family's options set away from their defaults. cache / threshold / factor
    select Fast-dLLM's accelerated sampler of the family (opt-in, lossy; docs/FAST_DECODING.md);
    speculate > 0 its self-speculative variant (opt-in, exact; docs/MODELS.md).
    Raises InputError for a value outside its range or threshold and factor together."""
    max_new_tokens: int = option(128, int, "tokens to generate (LLaDA's gen_length)", least=1,
                                 flags=("--gen-length", "--max-new-tokens"))
    steps: int | None = option(None, int, "denoising steps (default: the model's generation_config.json steps, "
                               "rounded up to a multiple of the blocks and at most one per generated token; "
                               "one per generated token where it sets none)", optional=True, least=1)
    block_length: int | None = option(None, int, "semi-autoregressive block (default: one block)", optional=True,
                                      least=1, sampler=LLADA)
    temperature: float = option(0.0, float, "0: most likely tokens; > 0: sampled", least=0)
    cfg_scale: float = option(0.0, float, "classifier-free guidance scale (0: off)", least=0, sampler=LLADA)
    remasking: str = option("low_confidence", str, "which positions to keep", sampler=LLADA,
                            choices=("low_confidence", "random"))
    confidence_dtype: str = option("model", str, "confidences in the model dtype (current code) or float64 "
                                   "(older code)", sampler=LLADA, choices=("model", "float64"))
    logits_eos_inf: bool = option(False, bool, "never generate end-of-text (Appendix B.4 of the LLaDA paper)",
                                  sampler=LLADA)
    confidence_eos_eot_inf: bool = option(False, bool, "end-of-text / end-of-turn never win on confidence "
                                          "(Appendix B.4)", sampler=LLADA)
    alg: str = option("maskgit_plus", str, "the remasking algorithm", sampler=DREAM,
                      choices=("origin", "maskgit_plus", "topk_margin", "entropy"))
    alg_temp: float | None = option(None, float, "> 0 draws positions by confidence, at this temperature",
                                    optional=True, sampler=DREAM)
    top_p: float | None = option(None, float, "nucleus sampling threshold in (0, 1]", optional=True, sampler=DREAM)
    top_k: int | None = option(None, int, "sample from the k most likely tokens", optional=True, least=1,
                               sampler=DREAM)
    eps: float = option(1e-3, float, "the last timestep of the schedule", sampler=DREAM)
    seed: int | None = option(None, int, "random seed (sampling runs repeat exactly)", optional=True,
                              cli_default=0)
    # Fast-dLLM (opt-in, lossy; docs/FAST_DECODING.md): block K/V cache and parallel commits
    cache: str = option("none", str, "block K/V cache: none, prefix or dual", sampler=FAST, choices=CACHE_CHOICES)
    threshold: float | None = option(None, float, "commit every position at or above this confidence",
                                     optional=True, sampler=FAST)
    factor: float | None = option(None, float, "the factor rule (rank n needs 1 - factor/(n+1))", optional=True,
                                  sampler=FAST)
    # block diffusion (LLaDA2.x, SDAR; runtime/samplers/block_diffusion.py): LLaDA2.1's token editing
    # (editing_threshold set: its sampler; its checkpoint's generate() sets it by default), the stop
    editing_threshold: float | None = option(None, float, "LLaDA2.1 token editing: rewrite a filled position whose "
                                             "prediction changed above this probability (unset: LLaDA2.0's sampler)",
                                             optional=True, least=0, sampler=BLOCK)
    max_post_steps: int = option(16, int, "LLaDA2.1: editing steps after a block is filled", least=0, sampler=BLOCK)
    num_to_transfer: int = option(1, int, "LLaDA2.1: masked positions filled per step at least", least=1,
                                  sampler=BLOCK)
    eos_early_stop: bool = option(True, bool, "stop after the block where the answer first holds end-of-text (off: "
                                  "every block runs, the published default; the answer is the same)", sampler=BLOCK)
    eos_id: int | None = option(None, int, "the end-of-text id this request stops at (default: the model's)",
                                optional=True, least=0, sampler=BLOCK)
    # self-speculative decoding (exact: the step-by-step tokens; docs/MODELS.md): draft this many
    # commits from one forward, verify them in one batched forward of that many canvases
    speculate: int = option(0, int, "draft K commits from one forward and verify them in one forward of K "
                            "canvases (0: off; exact, greedy samplers only)", least=0, sampler=SPEC)

    def __post_init__(self):
        if self.cache not in CACHE_CHOICES:
            raise InputError(f"cache={self.cache!r} is not one of {CACHE_CHOICES}", param="cache")
        for name in ("threshold", "factor"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                raise InputError(f"{name}={v!r} must be a number or None", param=name)
        if self.threshold is not None and not 0 < self.threshold <= 1:
            raise InputError(f"threshold={self.threshold} must be in (0, 1] (a probability; "
                             "Fast-dLLM's evaluations use 0.9)", param="threshold")
        if self.factor is not None and not self.factor > 0:
            raise InputError(f"factor={self.factor} must be positive (Fast-dLLM's factor rule commits the "
                             "n-th most confident position when its confidence is >= 1 - factor / (n + 1))",
                             param="factor")
        if self.threshold is not None and self.factor is not None:
            raise InputError("threshold and factor are two alternative commit rules; set one of them", param="factor")

    @property
    def accelerated(self) -> bool:
        """Whether this request asks for a Fast-dLLM sampler (a cache or a parallel commit rule)."""
        return self.cache != "none" or self.threshold is not None or self.factor is not None

    @classmethod
    def coerce(cls, value: GenerationConfig | dict | None) -> GenerationConfig:
        return coerce(cls, value)


OPTIONS: dict[str, Option] = {f.name: f.metadata["option"] for f in fields(GenerationConfig)}
SHARED_OPTIONS = frozenset(n for n, o in OPTIONS.items() if o.sampler is None)
GENERATION_DEFAULTS = GenerationConfig()


DEFAULTS_FILE = "generation_config.json"
_CANVAS_WORDS = ("max_new_tokens", "gen_length")   # the engine's two names of the canvas length


def name_defaults(message: str, given, defaults: dict) -> str:
    """An error message with "(from generation_config.json)" after each option value it names
    ("steps 8", "block_length=4") that came from the checkpoint's generation_config.json, not from
    the caller: the caller never set it, so the message says where it came from. given: the
    option names the caller set (None values count as unset); defaults: the file's fields
    (model.generation_defaults; gen_length is max_new_tokens)."""
    names = [k for k, v in given.items() if v is not None] if isinstance(given, dict) else list(given)
    given = {"max_new_tokens" if k == "gen_length" else k for k in names}
    for key, value in defaults.items():
        name = "max_new_tokens" if key == "gen_length" else key
        if name in given or not isinstance(value, (int, float, str)) or isinstance(value, bool):
            continue
        shown = repr(value) if isinstance(value, str) else str(value)
        for word in _CANVAS_WORDS if name == "max_new_tokens" else (name,):
            pattern = rf"\b{word}[ =]{re.escape(shown)}(?![\w.])"
            message, n = re.subn(pattern, lambda m: f"{m.group(0)} (from {DEFAULTS_FILE})", message, count=1)
            if n:
                break
    return message
