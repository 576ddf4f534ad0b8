"""The official calling conventions as drop-in functions.

Replace the official import with Mosaic's and keep the call:

    from generate import generate                      # GSAI-ML/LLaDA generate.py
    from mosaic.compat import generate                 # the same arguments, the same tokens

    model.diffusion_generate(input_ids, ...)           # Dream-org/Dream-v0 model method
    mosaic.compat.DreamModel(path).diffusion_generate(input_ids, ...)

`model` is a MosaicEngine (its plans are reused across calls), a loaded Model, or a checkpoint
folder / bundled name / preset (loaded once per process). Prompts are [B, L] token-id tensors,
left-padded with an attention mask (1 = token, 0 = padding) as the official code takes them, and
the results are what the official code returns: the whole [B, L + new] sequence tensor (the
caller's padding included) on the model's device. Random draws come from torch's default
generator of the model's device, as in the official code, so torch.manual_seed(s) before a call
reproduces an official run seeded s (on the CPU; on a GPU the planned path's Gumbel noise is a
different stream, labelled lossy). Where Mosaic differs, it refuses or says so (docs/MODELS.md):
a prompt holding the mask token is refused, LLaDA-MoE masks padded keys, and Dream's alg_temp
draw never leaves a position masked."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import GenerationConfig
from .engine import MosaicEngine
from .errors import InputError
from .models import Model
from .models.families import FAMILIES, config_to_hf, family_of

LLADA_MASK_ID = 126336   # generate.py's default mask_id: LLaDA-8B's mask token


@functools.lru_cache(maxsize=2)
def _engine_for(name: str) -> MosaicEngine:
    return MosaicEngine(name, {"progress": False})


def engine_of(model) -> MosaicEngine:
    """A MosaicEngine for `model`: itself, a new engine around a Model, or the one engine this
    process keeps per checkpoint name (loading is the slow part)."""
    if isinstance(model, MosaicEngine):
        return model
    if isinstance(model, Model):
        return MosaicEngine(model, {"progress": False})
    if isinstance(model, (str, Path)):
        return _engine_for(str(model))
    raise InputError(f"model must be a MosaicEngine, a Model or a checkpoint folder / name, not "
                     f"{type(model).__name__}")


LLADA_CALL, DREAM_CALL = "llada.generate", "dream.diffusion_generate"   # Family.published_call


def served_by(call: str) -> str:
    """The families whose published usage is `call`, for messages ("LLaDA, iLLaDA, LLaDA-MoE")."""
    return ", ".join(f.display for f in FAMILIES.values() if f.published_call == call)


def engine_for_call(model, call: str, refusal: str) -> MosaicEngine:
    """engine_of(model), InputError unless the model's family record says its published usage is
    `call` (Family.published_call). refusal: the message's start, formatted with the family."""
    engine = engine_of(model)
    cfg = engine.model.cfg
    if family_of(cfg).published_call != call:
        raise InputError(refusal.format(family=cfg.family))
    return engine


def llada_engine_of(model, mask_id: int, not_llada: str) -> MosaicEngine:
    """engine_of(model) for LLaDA's calls: InputError unless its family's published usage is
    LLaDA's generate.py (LLaDA, iLLaDA with mask_id=5, LLaDA-MoE) and its mask token is mask_id.
    not_llada: the refusal's start for another family, formatted with the family ("... this is a
    {family} model: use ... for Dream")."""
    engine = engine_for_call(model, LLADA_CALL, not_llada)
    cfg = engine.model.cfg
    if mask_id != cfg.mask_id:
        raise InputError(f"mask_id={mask_id} is not this model's mask token id ({cfg.mask_id}); pass "
                         f"mask_id={cfg.mask_id} (the default, {LLADA_MASK_ID}, is LLaDA-8B's; iLLaDA's is 5)")
    return engine


def _ids(prompt) -> torch.Tensor:
    t = prompt if isinstance(prompt, torch.Tensor) else torch.as_tensor(prompt)
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.shape[1] == 0 or t.is_floating_point() or t.dtype == torch.bool:
        raise InputError(f"the prompt must be a [B, L] tensor of token ids, got {t.dtype} of shape {list(t.shape)}")
    return t


def _run(engine: MosaicEngine, ids: torch.Tensor, attention_mask, gen: GenerationConfig, on_step=None):
    """The caller's prompt tensor (its padding as given) followed by the generated tokens."""
    out = engine.generate(inputs=ids, attention_mask=attention_mask, config=gen, progress=False, on_step=on_step)
    dev = engine.model.device
    return torch.cat([ids.to(dev), out.tokens.to(dev)], dim=1), out


@torch.no_grad()
def generate(model, prompt, attention_mask=None, steps=128, gen_length=128, block_length=128, temperature=0.,
             cfg_scale=0., remasking="low_confidence", mask_id=LLADA_MASK_ID, logits_eos_inf=False,
             confidence_eos_eot_inf=False) -> torch.Tensor:
    """LLaDA's generate() (GSAI-ML/LLaDA, generate.py) with its arguments and defaults, for every
    family whose published usage it is (LLaDA, LLaDA-MoE, iLLaDA: Family.published_call): the
    [B, L + gen_length] canvas after sampling.

    prompt [B, L] token ids; attention_mask [B, L] (1 = token, 0 = left padding) or None. mask_id
    must be the model's mask token (the default is LLaDA-8B's; pass LLaDA-MoE's 156895 as its own
    generate does, iLLaDA's 5 as the ML-GSAI/LLaDA README does): any other id is refused rather
    than sampled with. logits_eos_inf and
    confidence_eos_eot_inf use the model's end-of-text / end-of-turn ids from config.json (the
    official code hard-codes LLaDA-8B's 126081 and 126348). Raises InputError where the official
    code asserts (lengths that do not divide) or would compute garbage."""
    engine = llada_engine_of(model, mask_id, "generate() is LLaDA's sampler; this is a {family} model: use "
                                             "mosaic.compat.diffusion_generate() for Dream")
    gen = GenerationConfig(max_new_tokens=gen_length, steps=steps, block_length=block_length,
                           temperature=temperature, cfg_scale=cfg_scale, remasking=remasking,
                           logits_eos_inf=logits_eos_inf, confidence_eos_eot_inf=confidence_eos_eot_inf)
    return _run(engine, _ids(prompt), attention_mask, gen)[0]


@dataclass
class DreamOutput:
    """What Dream's diffusion_generate returns with return_dict_in_generate=True: sequences
    [B, L + new] and, with output_history=True, the canvas after every step (else None)."""
    sequences: torch.Tensor
    history: list[torch.Tensor] | None = None


# DreamGenerationConfig's own defaults (what a generation_config passed without a field holds)
DREAM_DEFAULTS = {"temperature": 0.0, "top_p": None, "top_k": None, "max_length": 20, "max_new_tokens": None,
                  "eps": 1e-3, "steps": 512, "alg": "origin", "alg_temp": None, "num_return_sequences": 1,
                  "return_dict_in_generate": False, "output_history": False, "mask_token_id": None}
# Without a generation_config the official method builds one with
# DreamGenerationConfig.from_model_config(model.config): every DreamGenerationConfig field is taken
# from the model config's to_dict() (None values dropped), and under transformers 4.46.2 (Dream's
# pinned version) every PretrainedConfig carries these generation defaults, so the official call
# samples at temperature 1.0 with top_k 50 (top_p 1.0 filters nothing) unless told otherwise.
# generation_config.json is not read on that path.
MODEL_CONFIG_DEFAULTS = {"max_length": 20, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
                         "num_return_sequences": 1, "return_dict_in_generate": False}


def official_base(hf_config: dict) -> dict:
    """The options the official diffusion_generate starts from without a generation_config:
    DreamGenerationConfig's defaults, then what from_model_config copies from the model config
    (transformers 4.46.2's generation defaults of PretrainedConfig, then config.json's own
    fields of those names; None values are dropped, as from_model_config drops them)."""
    model_dict = MODEL_CONFIG_DEFAULTS | {k: v for k, v in hf_config.items() if v is not None}
    return DREAM_DEFAULTS | {k: model_dict[k] for k in DREAM_DEFAULTS if k in model_dict}
_REFUSED = ("generation_tokens_hook_func", "generation_logits_hook_func")


@torch.no_grad()
def _dream_options(engine, generation_config, kwargs) -> dict:
    """The official call's options: kwargs first, then generation_config's attributes (or what
    the official method builds from the model config without one). InputError for another
    family, a token hook, or an unknown option."""
    cfg = engine_for_call(engine, DREAM_CALL, "diffusion_generate() is Dream's sampler; this is a {family} model: "
                          "use mosaic.compat.generate() for " + served_by(LLADA_CALL)).model.cfg
    hooks = [k for k in _REFUSED if kwargs.get(k) is not None]
    if hooks:
        raise InputError(f"{', '.join(hooks)} is not supported: Mosaic's planned path never holds full logits")
    known = set(DREAM_DEFAULTS) | {"pad_token_id", "bos_token_id", "eos_token_id"} | set(_REFUSED)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise InputError(f"unknown diffusion_generate options {unknown}; known: {sorted(known - set(_REFUSED))}")
    if generation_config is None:
        opt = official_base(engine.model.hf_config or config_to_hf(cfg))
    else:
        opt = dict(DREAM_DEFAULTS)
        base = generation_config if isinstance(generation_config, dict) else vars(generation_config)
        opt |= {k: base[k] for k in DREAM_DEFAULTS if k in base}
    return opt | {k: v for k, v in kwargs.items() if k in DREAM_DEFAULTS}


def diffusion_generate(model, inputs=None, generation_config=None, attention_mask=None, **kwargs):
    """Dream's model.diffusion_generate (Dream-org/Dream-v0, generation_utils.py) as a function
    of the model: the [B, L + new] sequences tensor, or a DreamOutput when
    return_dict_in_generate=True.

    Options: kwargs first, then the attributes of generation_config (a DreamGenerationConfig or
    a dict; a field it lacks takes DreamGenerationConfig's default: temperature 0.0, top_p and
    top_k None, max_length 20, steps 512, eps 1e-3, alg 'origin', alg_temp None). Without a
    generation_config the official method builds one from the model config (official_base):
    under transformers 4.46.2, Dream's pinned version, that means temperature 1.0 and top_k 50
    (top_p 1.0), the rest as above, and any of those fields config.json sets. max_new_tokens None
    lets max_length decide (its default 20 means 20 new tokens, capped so that prompt + new
    tokens stay within max_position_embeddings). The token hook functions are refused (Mosaic
    never materialises full logits on its planned path). generation_config.json is not read,
    as the official method does not read it either."""
    engine = engine_of(model)
    cfg = engine.model.cfg
    opt = _dream_options(engine, generation_config, kwargs)
    if opt["mask_token_id"] is not None and opt["mask_token_id"] != cfg.mask_id:
        raise InputError(f"mask_token_id={opt['mask_token_id']} is not this model's mask token id ({cfg.mask_id})")
    ids = _ids(inputs) if inputs is not None else None
    if ids is None:
        raise InputError("diffusion_generate() needs inputs: a [B, L] tensor of prompt token ids")
    n_ret = opt["num_return_sequences"]
    if not isinstance(n_ret, int) or n_ret < 1:
        raise InputError(f"num_return_sequences must be a positive integer, got {n_ret!r}")
    if n_ret > 1:
        ids = ids.repeat_interleave(n_ret, dim=0)
        if attention_mask is not None:
            attention_mask = torch.as_tensor(attention_mask).repeat_interleave(n_ret, dim=0)
    new = _new_tokens(opt, ids.shape[1], cfg.max_seq_len, explicit_max_length=kwargs.get("max_length") is not None)
    gen = GenerationConfig(max_new_tokens=new, steps=opt["steps"], temperature=opt["temperature"],
                           alg=opt["alg"], alg_temp=opt["alg_temp"], top_p=opt["top_p"], top_k=opt["top_k"],
                           eps=opt["eps"])
    history = [] if opt["return_dict_in_generate"] and opt["output_history"] else None
    dev = engine.model.device

    def keep(_, x):
        history.append(torch.cat([ids.to(dev), x[:, -new:]], dim=1))
    sequences, _ = _run(engine, ids, attention_mask, gen, keep if history is not None else None)
    if opt["return_dict_in_generate"]:
        return DreamOutput(sequences, history)
    return sequences


def _new_tokens(opt: dict, prompt_len: int, max_positions: int, explicit_max_length: bool) -> int:
    """Tokens to generate, as Dream's _prepare_generated_length decides: max_new_tokens if set;
    else max_length (the default 20 means 20 new tokens, capped at max_position_embeddings)."""
    if opt["max_new_tokens"] is not None:
        return opt["max_new_tokens"]
    max_length = opt["max_length"]
    if not explicit_max_length and max_length == DREAM_DEFAULTS["max_length"]:
        max_length = min(max_length + prompt_len, max_positions)
    if prompt_len >= max_length:
        raise InputError(f"the prompt has {prompt_len} tokens but max_length is {max_length}: nothing is left to "
                         "generate; set max_new_tokens")
    return max_length - prompt_len


class DreamModel:
    """A Dream model whose .diffusion_generate(...) mirrors the published model method:
    DreamModel('path/to/Dream-v0-Instruct-7B').diffusion_generate(input_ids, attention_mask=...,
    max_new_tokens=256, steps=256, alg='entropy', ...). `model` as in diffusion_generate."""

    def __init__(self, model):
        self.engine = engine_for_call(model, DREAM_CALL, "DreamModel needs a Dream model, got {family}")

    @property
    def device(self) -> torch.device:
        return self.engine.model.device

    def diffusion_generate(self, inputs=None, generation_config=None, **kwargs):
        return diffusion_generate(self.engine, inputs, generation_config, **kwargs)
