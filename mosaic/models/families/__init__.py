"""The model families, one record each (base.py: what a record holds), and the lookups the
engine uses: family_of(cfg), config_from_hf(raw), config_to_hf(cfg), PRESETS.

Every module of this package that defines FAMILY (a Family) is a family: adding one is a module
here, its tests and a docs/MODELS.md row (docs/DESIGN.md "Where to change what"). The modules are
imported here, in name order, once."""

from __future__ import annotations

import importlib
import pkgutil

from ...checkpoint_fields import check_fields
from ...config import ModelConfig
from ...errors import CheckpointError
from .base import Family, Samplers, qkv_widths

RECORDS = tuple(importlib.import_module(f"{__name__}.{m.name}") for m in sorted(pkgutil.iter_modules(__path__),
                                                                                key=lambda m: m.name))
FAMILIES: dict[str, Family] = {m.FAMILY.name: m.FAMILY for m in RECORDS if hasattr(m, "FAMILY")}
PRESETS: dict[str, ModelConfig] = {k: v for f in FAMILIES.values() for k, v in f.presets.items()}


def family_of(cfg: ModelConfig | str) -> Family:
    """The record of a ModelConfig's family (or of a family name). Raises KeyError naming the
    known families for a name no record has."""
    name = cfg if isinstance(cfg, str) else cfg.family
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"no model family {name!r}; families: {', '.join(FAMILIES)}") from None


def config_from_hf(raw: dict) -> ModelConfig:
    """Parse a config.json dict with the record whose model_type (and claims) match. Raises
    CheckpointError for an unknown model_type, and naming the field for a value Mosaic cannot
    run (the record's refused table: checkpoint_fields.check_fields)."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"config.json holds a {type(raw).__name__}, not an object of fields")
    mtype = str(raw.get("model_type", "")).lower()
    for fam in FAMILIES.values():
        if mtype in fam.model_types and (fam.claims is None or fam.claims(raw)):
            check_fields(raw, fam.refused, fam.implemented)
            return fam.parse(raw)
    known = ", ".join(f"{', '.join(repr(t) for t in f.model_types)} ({f.display})" for f in FAMILIES.values())
    raise CheckpointError(f"unknown model_type {raw.get('model_type')!r} in config.json; supported: {known}")


def config_to_hf(cfg: ModelConfig) -> dict:
    """config.json in the family's published field names (the inverse of config_from_hf)."""
    return family_of(cfg).to_hf(cfg)


__all__ = ["FAMILIES", "PRESETS", "RECORDS", "Family", "Samplers", "config_from_hf", "config_to_hf", "family_of",
           "qkv_widths"]
