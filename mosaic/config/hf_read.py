"""Reading a config.json dict: the typed field getters every family record's parser uses
(models/families/), and the geometry checks every parsed ModelConfig passes. Each raises
CheckpointError naming the field."""

from __future__ import annotations

from ..errors import CheckpointError


def need(raw: dict, *names: str, kind=int):
    """The first of `names` present (not null), as `kind`; CheckpointError when none is."""
    for n in names:
        if raw.get(n) is not None:
            return as_kind(raw, n, kind)
    raise CheckpointError(f"config.json lacks {' / '.join(names)}")


def get(raw: dict, name: str, default):
    """raw[name] as the default's type, or `default` when absent or null."""
    v = raw.get(name)
    return default if v is None else as_kind(raw, name, type(default)) if default is not None else v


def as_kind(raw: dict, name: str, kind):
    """raw[name] converted to `kind` (int, float, bool, str); CheckpointError for a value of
    another kind (a bool is not a number, a list or an object is not a scalar)."""
    v = raw[name]
    if isinstance(v, bool) and kind is not bool or isinstance(v, (list, dict, str)) and kind is not str:
        raise CheckpointError(f"config.json: {name}={v!r} is not a {kind.__name__}")
    try:
        return kind(v)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config.json: {name}={v!r} is not a {kind.__name__}") from e


def theta(raw: dict, default: float) -> float:
    """rope_theta, or rope_parameters.rope_theta as transformers >= 5 writes it."""
    rope = raw.get("rope_parameters")
    if raw.get("rope_theta") is None and isinstance(rope, dict) and rope.get("rope_theta") is not None:
        return as_kind(rope, "rope_theta", float)
    return get(raw, "rope_theta", default)


def trained_length(raw: dict, default: int) -> int:
    """The trained length: max_sequence_length (LLaDA's name) or max_position_embeddings (HF's),
    whichever the file has (the first when both), else the family's published default."""
    for name in ("max_sequence_length", "max_position_embeddings"):
        if raw.get(name) is not None:
            return get(raw, name, default)
    return default


def head_size(raw: dict, hidden: int, heads: int, family: str) -> int:
    """hidden / heads, for a published attention that ignores head_dim: a config.json whose
    head_dim disagrees is refused (the code would run another geometry than the file says)."""
    if raw.get("head_dim") is not None and as_kind(raw, "head_dim", int) * heads != hidden:
        raise CheckpointError(f"config.json: head_dim={raw['head_dim']} but hidden_size / num_attention_heads = "
                              f"{hidden // heads}; the published {family} code uses the latter")
    return hidden // heads


def geometry_problems(cfg) -> list[str]:
    """What makes a ModelConfig's geometry unrunnable: non-positive sizes, heads that do not
    divide, an odd or too wide rotary width, more experts per token than experts."""
    sizes = {"hidden size": cfg.hidden, "layers": cfg.num_layers, "attention heads": cfg.num_heads,
             "key/value heads": cfg.num_kv_heads, "head size": cfg.head_dim, "FFN width": cfg.ffn,
             "vocabulary": cfg.vocab}
    bad = [f"{k} {v}" for k, v in sizes.items() if v <= 0]
    if cfg.num_kv_heads > 0 and cfg.num_heads % cfg.num_kv_heads:
        bad.append(f"{cfg.num_heads} attention heads are not a multiple of {cfg.num_kv_heads} key/value heads")
    if cfg.rot_dim % 2 or not 0 < cfg.rot_dim <= cfg.head_dim:
        bad.append(f"rotary width {cfg.rot_dim} (must be even and at most the head size {cfg.head_dim})")
    if cfg.num_experts and not 0 < cfg.top_k <= cfg.num_experts:
        bad.append(f"{cfg.top_k} experts per token of {cfg.num_experts}")
    return bad


def checked(cfg, extra: list[str] | None = None):
    """cfg, or CheckpointError listing every geometry problem (and the family's own, `extra`)."""
    bad = geometry_problems(cfg) + list(extra or ())
    if bad:
        raise CheckpointError(f"config.json describes a model that cannot run: {'; '.join(bad)}")
    return cfg


__all__ = ["as_kind", "checked", "geometry_problems", "get", "head_size", "need", "theta", "trained_length"]
