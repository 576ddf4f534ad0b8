"""config.json fields: the rules a family record (models/families/<name>.py) writes its table of
implemented and refused fields with, the fields that never touch inference, the special token
ids, and the one function that judges a checkpoint's fields against its family's table.

A field that changes the math is either read by the family's parser or refused with a
CheckpointError naming it; a field nobody knows is named in a warning, never dropped silently.
Sources per family: the records and docs/MODELS.md."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from .errors import CheckpointError


class ConfigFieldWarning(UserWarning):
    """config.json has fields Mosaic does not know (they are ignored)."""


def is_(*values) -> Callable[[Any], bool]:
    """A rule's test: the value is one of `values`."""
    return lambda v: v in values


OFF = is_(None, False, 0)             # absent, null, false or 0
NONE = is_(None)
ONE = is_(None, 1, 1.0)

# field -> (the values Mosaic implements, what they are, why others are refused)
Rule = tuple[Callable[[Any], bool], str, str]
COMMON: dict[str, Rule] = {
    "quantization_config": (NONE, "absent", "quantized weights are not supported (bf16/fp16/fp32 only)"),
    "rope_scaling": (NONE, "null", "RoPE scaling (YaRN, linear, dynamic) is not implemented"),
}

SPECIAL = ("mask_token_id", "eos_token_id", "bos_token_id", "eot_token_id", "pad_token_id")
# fields that do not change inference: training, caching, dropout, bookkeeping
INERT = {
    "model_type", "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version",
    "_name_or_path", "use_cache", "initializer_range", "init_std", "init_fn", "init_device",
    "init_cutoff_factor", "precision", "attention_dropout", "residual_dropout", "embedding_dropout",
    "flash_attention", "block_group_size", "alibi_bias_max", "attention_layer_norm_with_affine",
    "output_router_logits", "router_aux_loss_coef", "dense_intermediate_size", "max_window_layers",
    "sliding_window", "output_attentions", "output_hidden_states", "return_dict", "is_encoder_decoder",
    "pretraining_tp", "rope_type", "use_qk_norm", "tokenizer_class", "pad_token", "bos_token",
    "eos_token", "mask_token", "generation_config", "id2label", "label2id", "problem_type",
    "resid_pdrop", "embd_pdrop", "output_dropout", "use_return_dict",
}


def check_fields(raw: dict, refused: dict[str, Rule], implemented: frozenset[str] | set[str]) -> None:
    """Raise CheckpointError for every field whose value asks for math Mosaic does not run (all
    of them named at once; `refused`: the family's table, with COMMON); warn (ConfigFieldWarning)
    about fields neither refused, nor `implemented` (read by the family's parser), nor special
    ids, nor inert."""
    bad = []
    for name, (ok, allowed, why) in refused.items():
        if name in raw and not ok(raw[name]):
            bad.append(f"{name}={raw[name]!r} ({why}; supported: {allowed})")
    rope = raw.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
        bad.append(f"rope_parameters.rope_type={rope['rope_type']!r} (RoPE scaling is not implemented; "
                   "supported: 'default')")
    if bad:
        raise CheckpointError(f"config.json asks for what Mosaic does not implement: {'; '.join(bad)}")
    known = set(refused) | set(implemented) | set(SPECIAL) | INERT
    unknown = sorted(k for k in raw if k not in known)
    if unknown:
        warnings.warn(f"config.json fields Mosaic does not know are ignored: {unknown} (if one of them "
                      "changes the model's math, the tokens will differ from the published code's)",
                      ConfigFieldWarning, stacklevel=3)


def special_ids(raw: dict, defaults: dict[str, int | None], vocab: int) -> dict[str, Any]:
    """ModelConfig's token-id fields from config.json. Absent or null: the family's published
    default (`defaults`: SPECIAL name -> id or None) when it lies inside the vocabulary, else None
    (no such token). A list of end-of-text ids (HF allows one) gives eos_id = the first and
    extra_eos_ids = the rest. A value that is not an id inside [0, vocab) is refused naming the
    field. The mask token is required."""
    out: dict[str, Any] = {}
    for name in SPECIAL:
        v = raw.get(name)
        if v is None:
            d = defaults[name]
            out[name] = d if d is not None and d < vocab else None
            if name == "mask_token_id" and out[name] is None:
                raise CheckpointError(f"config.json has no mask_token_id (the published default {d} is "
                                      f"outside this vocabulary of {vocab}); add the mask token's id")
            continue
        ids = v if isinstance(v, list) and name == "eos_token_id" else [v]
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise CheckpointError(f"config.json: {name}={v!r} is not a token id (an integer"
                                  f"{' or a list of them' if name == 'eos_token_id' else ''})")
        outside = [i for i in ids if not 0 <= i < vocab]
        if outside:
            raise CheckpointError(f"config.json: {name}={v!r} is outside the vocabulary [0, {vocab})")
        out[name] = ids[0]
        if name == "eos_token_id":
            out["extra"] = tuple(ids[1:])
    if out["mask_token_id"] == out["eos_token_id"]:
        raise CheckpointError(f"config.json: mask_token_id {out['mask_token_id']} is also eos_token_id; a "
                              "diffusion model needs a mask token of its own")
    if out["pad_token_id"] == out["mask_token_id"]:  # padding is filled with another id (engine.canvas)
        out["pad_token_id"] = None
    return {"mask_id": out["mask_token_id"], "eos_id": out["eos_token_id"], "bos_id": out["bos_token_id"],
            "eot_id": out["eot_token_id"], "pad_id": out["pad_token_id"], "extra_eos_ids": out.get("extra", ())}


# generation_config.json fields that are bookkeeping, not sampling
GENERATION_INERT = {"transformers_version", "_from_model_config", "_commit_hash"}
GENERATION_IDS = ("pad_token_id", "bos_token_id", "mask_token_id", "eot_token_id")


def generation_fields(data: dict, ids: dict[str, Any], vocab: int, sampling: set[str],
                      where: str = "generation_config.json") -> tuple[dict, dict[str, Any]]:
    """Split generation_config.json into (sampling defaults, token ids) and warn once, naming
    them, about the fields nothing reads.

    data: the file's object; ids: config.json's {"eos_id", "extra_eos_ids", "pad_id", ...} (as
    special_ids returns them); sampling: the GenerationConfig field names (and aliases) that
    become request defaults. Returns the sampling fields as given (GenerationConfig validates
    them per request) and `ids` with every end-of-text id of the file added: HF's generate stops
    at any id of `eos_token_id` (an int or a list), so a list in either file ends the text at any
    of its ids (the first of config.json stays eos_id). Other token ids that differ from
    config.json's are named in the warning (config.json's are used, as the official code uses
    the model config's). Raises CheckpointError for an end-of-text id outside [0, vocab)."""
    defaults = {k: v for k, v in data.items() if k in sampling}
    out = dict(ids)
    eos = data.get("eos_token_id")
    if eos is not None:
        listed = eos if isinstance(eos, list) else [eos]
        if not listed or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in listed):
            raise CheckpointError(f"{where}: eos_token_id={eos!r} is not a token id in [0, {vocab}) or a list of them")
        have = [i for i in [out["eos_id"], *out["extra_eos_ids"]] if i is not None]
        more = [i for i in listed if i not in have]
        if out["eos_id"] is None and more:
            out["eos_id"], more = more[0], more[1:]
        out["extra_eos_ids"] = tuple(out["extra_eos_ids"]) + tuple(dict.fromkeys(more))
    ignored = []
    for name in GENERATION_IDS:
        short = name.replace("_token_id", "_id")
        if data.get(name) is not None and data[name] != out.get(short):
            ignored.append(f"{name}={data[name]!r} (config.json's {out.get(short)!r} is used)")
    if data.get("max_length") is not None:
        ignored.append(f"max_length={data['max_length']!r} (a total-length cap of transformers' generate; "
                       "give max_new_tokens)")
    known = sampling | GENERATION_INERT | set(GENERATION_IDS) | {"eos_token_id", "max_length"}
    ignored += sorted(k for k in data if k not in known)
    if ignored:
        warnings.warn(f"{where} fields Mosaic does not read are ignored: {', '.join(ignored)}",
                      ConfigFieldWarning, stacklevel=3)
    return defaults, out
