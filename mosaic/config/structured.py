"""What a structured-output request asks for (`ConstraintSpec`), read once from generate()'s
keywords, the CLI or the server's fields; compiled against a model's vocabulary by
runtime/grammar.py (docs/STRUCTURED.md).

Kinds: `json_schema` (a JSON Schema, as JSON text), `regex` (the whole answer matches it),
`choice` (the answer is one of the strings), `grammar` (a context-free grammar: refused, see
runtime/grammar.py). `json_object` (OpenAI's response_format) is any JSON object nested up to two
levels (ANY_OBJECT)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import InputError

KINDS = ("json_schema", "regex", "choice", "grammar")
# OpenAI's json_object: any JSON object, nested two levels (values: scalars, arrays of scalars, objects of
# scalars). outlines-core unrolls a fully generic object to a DFA that took 82 s to build for 95 tokens;
# this one takes 1.6 s (1,111 vs 271 states)
_SCALAR = [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]
ANY_OBJECT = json.dumps({"type": "object", "additionalProperties": {"anyOf": _SCALAR + [
    {"type": "array", "items": {"anyOf": _SCALAR}}, {"type": "object", "additionalProperties": {"anyOf": _SCALAR}}]}})


@dataclass(frozen=True)
class ConstraintSpec:
    """kind: one of KINDS; value: JSON text (json_schema), a pattern (regex, grammar) or a tuple
    of strings (choice); name: where it came from, for messages ('json_schema', 'guided_regex')."""
    kind: str
    value: str | tuple
    name: str = ""

    def label(self) -> str:
        """The lossy label of a constrained run (Generation.lossy)."""
        what = {"json_schema": "a JSON schema", "regex": "a regex", "choice": f"{len(self.value)} choices",
                "grammar": "a grammar"}[self.kind]
        return (f"structured: answer constrained to {what}; commits restricted to the next free positions of "
                "the answer, tokens masked by the grammar (not the reference sampler's tokens)")


def schema_text(schema, name: str = "json_schema") -> str:
    """A JSON Schema given as a dict, a JSON string or a pydantic model class -> JSON text.
    InputError when it is none of these or not a JSON object."""
    if hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InputError(f"{name} is not valid JSON: {e}", param=name) from None
    if not isinstance(schema, dict):
        raise InputError(f"{name} must be a JSON object (a JSON Schema), got {type(schema).__name__}", param=name)
    return json.dumps(schema)


def spec_of(json_schema=None, regex: str | None = None, choice=None, grammar: str | None = None,
            names: dict | None = None) -> ConstraintSpec | None:
    """The one constraint among the arguments (None when none is given); InputError when several
    are given or a value has the wrong type. names: how the caller calls each argument."""
    names = {"json_schema": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"} | (names or {})
    given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("choice", choice),
                               ("grammar", grammar)) if v is not None}
    if not given:
        return None
    if len(given) > 1:
        raise InputError(f"give one output constraint, not {len(given)}: {', '.join(names[k] for k in given)}")
    kind, value = next(iter(given.items()))
    name = names[kind]
    if kind == "json_schema":
        return ConstraintSpec(kind, schema_text(value, name), name)
    if kind == "choice":
        if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value or \
                not all(isinstance(c, str) and c for c in value):
            raise InputError(f"{name} must be a non-empty list of non-empty strings, got {value!r}", param=name)
        return ConstraintSpec(kind, tuple(dict.fromkeys(value)), name)
    if not isinstance(value, str) or not value:
        raise InputError(f"{name} must be a non-empty string, got {value!r}", param=name)
    return ConstraintSpec(kind, value, name)


def spec_of_response_format(fmt, name: str = "response_format") -> ConstraintSpec | None:
    """OpenAI's response_format: {"type": "text"} (None), {"type": "json_object"} (any JSON
    object), {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}; a pydantic
    model class is its schema. InputError names what is wrong and what is allowed."""
    if fmt is None:
        return None
    if hasattr(fmt, "model_json_schema"):
        return ConstraintSpec("json_schema", schema_text(fmt, name), name)
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InputError(f"{name} must be an object with a 'type': 'text', 'json_object' or 'json_schema'",
                         param=name)
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_schema", ANY_OBJECT, name)
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise InputError(f"{name}.json_schema must be an object with a 'schema' (and a 'name', optionally "
                             "'strict')", param=f"{name}.json_schema")
        return ConstraintSpec("json_schema", schema_text(inner["schema"], f"{name}.json_schema.schema"), name)
    raise InputError(f"{name}.type {kind!r} is not one of 'text', 'json_object', 'json_schema'", param=f"{name}.type")
