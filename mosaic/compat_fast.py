"""Fast-dLLM's published call signatures as drop-in functions (NVlabs/Fast-dLLM; the versions
docs/FAST_DECODING.md pins).

    from generate import generate_with_dual_cache           # Fast-dLLM llada/generate.py
    from mosaic.compat_fast import generate_with_dual_cache  # the same arguments, tokens and NFE

    model.diffusion_generate(ids, threshold=0.9, block_length=32, dual_cache=True, ...)  # dream/
    mosaic.compat_fast.diffusion_generate(model, ids, threshold=0.9, block_length=32, dual_cache=True, ...)

Each calls MosaicEngine.generate with the cache / threshold / factor options of the Fast-dLLM
samplers (runtime/samplers/fast_*.py), so tokens and forwards are those of the published loops
(tests/test_compat_fast.py against tests/plain_fast.py), except where docs/FAST_DECODING.md 1.3
says the published loop crashes or never returns. `model` is a MosaicEngine, a Model or a
checkpoint name (mosaic.compat.engine_of); random draws come from torch's default generator of
the model's device, as in the published code (torch.manual_seed(s) reproduces a run seeded s on
the CPU)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .compat import (
    DREAM_CALL,
    DREAM_DEFAULTS,
    LLADA_MASK_ID,
    DreamOutput,
    _ids,
    _new_tokens,
    _run,
    config_to_hf,
    engine_for_call,
    llada_engine_of,
    official_base,
)
from .config import GenerationConfig
from .errors import InputError


def _llada(model, prompt, steps, gen_length, block_length, temperature, remasking, mask_id, threshold, factor,
           step_callback, cache: str) -> tuple[torch.Tensor, int]:
    engine = llada_engine_of(model, mask_id, "Fast-dLLM's generate functions are LLaDA's; this is a {family} "
                                             "model: use mosaic.compat_fast.diffusion_generate() for Dream")
    # the published confidence is the float64 softmax probability (get_transfer_index), also on
    # the plain schedule without a cache, where Mosaic's exact LLaDA sampler runs
    gen = GenerationConfig(max_new_tokens=gen_length, steps=steps, block_length=block_length,
                           temperature=temperature, remasking=remasking, cache=cache, threshold=threshold,
                           factor=factor, confidence_dtype="float64")
    on_step = None if step_callback is None else (lambda i, _x: step_callback(i - 1))
    x, out = _run(engine, _ids(prompt), None, gen, on_step)
    return x, int(out.stats.get("nfe", out.steps))


@torch.no_grad()
def generate(model, prompt, steps: int = 128, gen_length: int = 128, block_length: int = 128,
             temperature: float = 0.0, remasking: str = "low_confidence", mask_id: int = LLADA_MASK_ID,
             threshold: float | None = None, factor: float | None = None,
             step_callback: Callable[[int], None] | None = None) -> tuple[torch.Tensor, int]:
    """Fast-dLLM llada/generate.py `generate` (no cache): (x [B, L + gen_length], nfe).

    prompt [B, L] token ids (the published function takes no attention mask); threshold: commit
    every candidate at or above it (the most confident always); factor: the factor rule; neither:
    the count schedule (steps / blocks per block, the exact LLaDA sampler with float64
    confidence). step_callback(i) after every forward, i counting from 0. Raises InputError where
    the published code asserts (lengths that do not divide) or for another family's model."""
    return _llada(model, prompt, steps, gen_length, block_length, temperature, remasking, mask_id, threshold,
                  factor, step_callback, "none")


@torch.no_grad()
def generate_with_prefix_cache(model, prompt, steps: int = 128, gen_length: int = 128, block_length: int = 128,
                               temperature: float = 0.0, remasking: str = "low_confidence",
                               mask_id: int = LLADA_MASK_ID, threshold: float | None = None,
                               factor: float | None = None,
                               step_callback: Callable[[int], None] | None = None) -> tuple[torch.Tensor, int]:
    """Fast-dLLM `generate_with_prefix_cache`: as generate, the K/V left of the current block
    cached across its steps. Returns (x, nfe)."""
    return _llada(model, prompt, steps, gen_length, block_length, temperature, remasking, mask_id, threshold,
                  factor, step_callback, "prefix")


@torch.no_grad()
def generate_with_dual_cache(model, prompt, steps: int = 128, gen_length: int = 128, block_length: int = 128,
                             temperature: float = 0.0, remasking: str = "low_confidence",
                             mask_id: int = LLADA_MASK_ID, threshold: float | None = None,
                             factor: float | None = None,
                             step_callback: Callable[[int], None] | None = None) -> tuple[torch.Tensor, int]:
    """Fast-dLLM `generate_with_dual_cache`: as generate, the K/V of every position outside the
    current block cached across its steps. Returns (x, nfe)."""
    return _llada(model, prompt, steps, gen_length, block_length, temperature, remasking, mask_id, threshold,
                  factor, step_callback, "dual")


FAST_DREAM_OPTIONS = ("threshold", "block_length", "dual_cache", "use_cache")
DREAM_OPTIONS = ("temperature", "top_p", "top_k", "max_length", "max_new_tokens", "eps", "steps", "alg",
                 "alg_temp", "num_return_sequences", "return_dict_in_generate", "output_history", "mask_token_id")


@torch.no_grad()
def diffusion_generate(model, inputs=None, generation_config=None, attention_mask=None, threshold: float = 0.9,
                       block_length: int = 32, dual_cache: bool = False, use_cache: bool = True, **kwargs):
    """Fast-dLLM's Dream `model.diffusion_generate` (dream/model/generation_utils_block.py; with
    use_cache=False generation_utils.py's uncached loop): the [B, L + new] sequences, or a
    DreamOutput with return_dict_in_generate=True (history None).

    Its own options and defaults: threshold 0.9 (read with alg='confidence_threshold' only),
    block_length 32, dual_cache False (prefix cache), use_cache True. alg='confidence_threshold'
    commits the block's most confident masked position and every other one at or above the
    threshold; any other alg follows Dream's schedule per block ranked by negative entropy, as
    the published loop does whatever alg says. The other options, and what they inherit without
    a generation_config (temperature 1.0, top_k 50 under transformers 4.46.2), are
    mosaic.compat.diffusion_generate's. Raises InputError for unknown options or a non-Dream model."""
    engine = engine_for_call(model, DREAM_CALL, "this diffusion_generate is Dream's Fast-dLLM sampler; this is a "
                             "{family} model: use generate / generate_with_prefix_cache / generate_with_dual_cache "
                             "for LLaDA")
    cfg = engine.model.cfg
    unknown = sorted(set(kwargs) - set(DREAM_OPTIONS) - {"pad_token_id", "bos_token_id", "eos_token_id"})
    if unknown:
        raise InputError(f"unknown diffusion_generate options {unknown}; known: "
                         f"{sorted(DREAM_OPTIONS + FAST_DREAM_OPTIONS)}")
    if generation_config is None:
        opt = official_base(engine.model.hf_config or config_to_hf(cfg))
    else:
        base = generation_config if isinstance(generation_config, dict) else vars(generation_config)
        opt = dict(DREAM_DEFAULTS) | {k: base[k] for k in DREAM_OPTIONS if k in base}
    opt |= {k: v for k, v in kwargs.items() if k in DREAM_OPTIONS}
    if opt["mask_token_id"] is not None and opt["mask_token_id"] != cfg.mask_id:
        raise InputError(f"mask_token_id={opt['mask_token_id']} is not this model's mask token id ({cfg.mask_id})")
    if opt["num_return_sequences"] != 1:
        raise InputError("num_return_sequences > 1 is not supported by the Fast-dLLM Dream drop-in")
    ids = _ids(inputs) if inputs is not None else None
    if ids is None:
        raise InputError("diffusion_generate() needs inputs: a [B, L] tensor of prompt token ids")
    new = _new_tokens(opt, ids.shape[1], cfg.max_seq_len, explicit_max_length=kwargs.get("max_length") is not None)
    by_threshold = opt["alg"] == "confidence_threshold"
    gen = GenerationConfig(
        max_new_tokens=new, steps=opt["steps"], temperature=opt["temperature"], top_p=opt["top_p"],
        top_k=opt["top_k"], eps=opt["eps"], alg="maskgit_plus" if by_threshold else "entropy",
        alg_temp=opt["alg_temp"], threshold=threshold if by_threshold else None,
        cache=("dual" if dual_cache else "prefix") if use_cache else "none",
        block_length=block_length if use_cache else None)
    sequences, _ = _run(engine, ids, attention_mask, gen)
    return DreamOutput(sequences, None) if opt["return_dict_in_generate"] else sequences
