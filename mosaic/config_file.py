"""Engine configs from YAML files: `mosaic generate --config engine.yaml`, `MosaicEngine(model,
"engine.yaml")`.

The file holds EngineConfig's fields (docs/CONFIG.md lists them), and optionally a
`calibration:` mapping, the record `mosaic calibrate` writes of how its `sparse:` section was
chosen: accepted and ignored (it configures nothing). PyYAML parses it; pydantic
validates it against the frozen dataclasses themselves (types, then each dataclass's own value
checks), so an error names the key's path, what was wrong and what is allowed, e.g.
`engine.yaml: sparse.ranges.1.keep: Value error, sparse keep=2.0 must be in (0, 1] ...`."""

from __future__ import annotations

from pathlib import Path

import yaml

from .config import ENGINE_ALIASES, EngineConfig, PrecisionConfig, PrecisionRange, SparseConfig, SparseRange
from .errors import ConfigFileError, InputError

SUFFIXES = (".yaml", ".yml")
RECORD_KEY = "calibration"   # a record beside the options (mosaic calibrate), read by nothing


def is_config_path(value) -> bool:
    return isinstance(value, (str, Path)) and str(value).lower().endswith(SUFFIXES)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last
    silently, so `dtype: float16` above `dtype: bfloat16` ran in bfloat16 without a word)."""


def _unique_mapping(loader, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (also at line {seen[key] + 1}): give each key once",
                key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_engine_config(path: str | Path, **overrides) -> EngineConfig:
    """EngineConfig from a YAML file (a mapping of its fields); `overrides` (non-None values)
    win over the file. Raises InputError naming the file and the offending key."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"config file {str(path)!r} does not exist")
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:   # one line: where, and what the parser expected
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigFileError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(raw, dict):
        raise ConfigFileError(f"{path}: the top level must be a mapping of engine options, got {type(raw).__name__}")
    record = raw.pop(RECORD_KEY, None)   # how `mosaic calibrate` chose the file's options: not an option
    if record is not None and not isinstance(record, dict):
        raise ConfigFileError(f"{path}: {RECORD_KEY}: the record `mosaic calibrate` writes is a mapping, "
                              f"got {type(record).__name__}")
    raw |= {k: v for k, v in overrides.items() if v is not None}
    both = [k for k in ENGINE_ALIASES if k in raw and ENGINE_ALIASES[k] in raw]
    if both:
        raise ConfigFileError(f"{path}: give {both[0]} or {ENGINE_ALIASES[both[0]]}, not both")
    raw = {ENGINE_ALIASES.get(k, k): v for k, v in raw.items()}   # the paper's names (max_seq_len)
    from pydantic import ConfigDict, TypeAdapter, ValidationError  # only needed to read files
    for cls in (EngineConfig, SparseConfig, SparseRange, PrecisionConfig, PrecisionRange):  # unknown key: an error
        cls.__pydantic_config__ = ConfigDict(extra="forbid")
    try:
        return TypeAdapter(EngineConfig).validate_python(raw)
    except ValidationError as e:
        raise ConfigFileError(f"{path}: {_problems(e.errors())}") from None


def _problems(errors: list[dict]) -> str:
    """pydantic's errors as "key.path: message", one per key: the union branches and class names
    pydantic puts in its locations are dropped, unknown keys list the allowed ones, and a field's
    own check (raised in __post_init__, located at the top) keeps its message, which names it."""
    out: dict[str, str] = {}
    for err in errors:
        loc = ".".join(str(p) for p in err["loc"] if isinstance(p, int) or str(p).isidentifier() and
                       not str(p)[:1].isupper())
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "unexpected_keyword_argument" or err["type"] == "extra_forbidden":
            parent = loc.rpartition(".")[0]
            cls = {"sparse": SparseConfig, "precision": PrecisionConfig}.get(parent.split(".")[0] if parent else "")
            if parent.count(".") or (parent and parent.split(".")[-1].isdigit()):
                cls = SparseRange if parent.startswith("sparse") else PrecisionRange
            fields = (cls or EngineConfig).__dataclass_fields__
            msg = f"unknown key; allowed: {', '.join(fields)}"
        out.setdefault(loc or "(file)", msg)
    # a union's other branch fails at the parent too ("precision: Input should be a valid tuple"):
    # the deepest location is the one that says what is wrong
    keep = {k: v for k, v in out.items() if not any(o.startswith(k + ".") for o in out)}
    return "; ".join(f"{k}: {v}" if k != "(file)" else v for k, v in keep.items())
