"""Engine configs from YAML files: `mosaic generate --config engine.yaml`, `MosaicEngine(model,
"engine.yaml")`.

The file holds EngineConfig's fields (docs/CONFIG.md lists them). PyYAML parses it; pydantic
validates it against the frozen dataclasses themselves (types, then each dataclass's own value
checks), so an error names the key's path, what was wrong and what is allowed, e.g.
`engine.yaml: sparse.ranges.1.keep: Value error, sparse keep=2.0 must be in (0, 1] ...`."""

from __future__ import annotations

from pathlib import Path

import yaml

from .config import ENGINE_ALIASES, EngineConfig, PrecisionConfig, PrecisionRange, SparseConfig, SparseRange
from .errors import InputError

SUFFIXES = (".yaml", ".yml")


def is_config_path(value) -> bool:
    return isinstance(value, (str, Path)) and str(value).lower().endswith(SUFFIXES)


def load_engine_config(path: str | Path, **overrides) -> EngineConfig:
    """EngineConfig from a YAML file (a mapping of its fields); `overrides` (non-None values)
    win over the file. Raises InputError naming the file and the offending key."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"config file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise InputError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise InputError(f"{path}: the top level must be a mapping of engine options, got {type(raw).__name__}")
    raw |= {k: v for k, v in overrides.items() if v is not None}
    both = [k for k in ENGINE_ALIASES if k in raw and ENGINE_ALIASES[k] in raw]
    if both:
        raise InputError(f"{path}: give {both[0]} or {ENGINE_ALIASES[both[0]]}, not both")
    raw = {ENGINE_ALIASES.get(k, k): v for k, v in raw.items()}   # the paper's names (max_seq_len)
    from pydantic import ConfigDict, TypeAdapter, ValidationError  # only needed to read files
    for cls in (EngineConfig, SparseConfig, SparseRange, PrecisionConfig, PrecisionRange):  # unknown key: an error
        cls.__pydantic_config__ = ConfigDict(extra="forbid")
    try:
        return TypeAdapter(EngineConfig).validate_python(raw)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '(top)'}: {err['msg']}" for err in e.errors())
        known = ", ".join(f.name for f in EngineConfig.__dataclass_fields__.values())
        raise InputError(f"{path}: {problems} (engine options: {known})") from None
