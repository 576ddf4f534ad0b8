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
from . import int_range

KINDS = ("json_schema", "regex", "choice", "grammar")
# OpenAI's json_object: any JSON object, nested two levels (values: scalars, arrays of scalars, objects of
# scalars). outlines-core unrolls a fully generic object to a DFA that took 82 s to build for 95 tokens;
# this one takes 1.6 s (1,111 vs 271 states)
_SCALAR = [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]
ANY_OBJECT = json.dumps({"type": "object", "additionalProperties": {"anyOf": _SCALAR + [
    {"type": "array", "items": {"anyOf": _SCALAR}}, {"type": "object", "additionalProperties": {"anyOf": _SCALAR}}]}})
# JSON Schema keywords outlines-core 0.2.14's schema-to-regex conversion passes over without encoding them
# (each tested: tests/config/test_structured_unenforced.py): the answer parses and follows the rest of the
# schema, but may break these. {"type": "integer", "maximum": 10} compiles to the regex of any integer
UNENFORCED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems", "contains",
              "minContains", "maxContains", "minProperties", "maxProperties", "propertyNames", "patternProperties",
              "dependentRequired", "dependentSchemas", "if", "then", "else", "contentEncoding", "contentMediaType",
              "contentSchema")
# keywords it drops when another one of the same schema wins: {keyword present: the siblings it drops}
SHADOWED = {"enum": ("minLength", "maxLength", "pattern", "format", "minItems", "maxItems"),
            "const": ("minLength", "maxLength", "pattern", "format", "minItems", "maxItems"),
            "minLength": ("pattern", "format"), "maxLength": ("pattern", "format"), "pattern": ("format",),
            "prefixItems": ("minItems", "maxItems")}
_ONE = ("items", "additionalProperties", "not", "unevaluatedProperties", "unevaluatedItems")   # a subschema
_MAPS = ("properties", "$defs", "definitions")          # {name: subschema}
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")     # [subschema]
NOT_ENFORCED = ("not enforced: outlines-core's JSON-schema-to-regex conversion does not encode this keyword; the "
                "answer follows the rest of the schema and may break it")


@dataclass(frozen=True)
class ConstraintSpec:
    """kind: one of KINDS; value: JSON text (json_schema), a pattern (regex, grammar) or a tuple
    of strings (choice); name: where it came from, for messages ('json_schema', 'guided_regex')."""
    kind: str
    value: str | tuple
    name: str = ""

    def label(self) -> str:
        """The lossy label of a constrained run (Generation.lossy); names the schema keywords
        that are not enforced (unenforced())."""
        what = {"json_schema": "a JSON schema", "regex": "a regex", "choice": f"{len(self.value)} choices",
                "grammar": "a grammar"}[self.kind]
        loose = self.unenforced()
        gap = f" (not enforced, the answer may break them: {', '.join(loose)})" if loose else ""
        return (f"structured: answer constrained to {what}{gap}; commits restricted to the next free positions of "
                "the answer, tokens masked by the grammar (not the reference sampler's tokens)")

    def unenforced(self) -> list[str]:
        """The schema's keywords the compiled grammar does not enforce, as paths from the schema's
        root ('maximum', 'properties.n.multipleOf'); [] for the other kinds."""
        return unenforced(json.loads(self.value)) if self.kind == "json_schema" else []


def _encoded(schema: dict, keyword: str) -> bool:
    """The cases of UNENFORCED that are enforced: an integer's bounds where int_range.py
    rewrites them into a range regex; minProperties 0 or 1 on an object without fixed properties
    (outlines-core: at least one member; 2 or more still allows one)."""
    if keyword in int_range.BOUNDS:
        return int_range.bounds(schema) is not None
    return keyword == "minProperties" and "properties" not in schema and schema[keyword] in (0, 1)


def unenforced(schema, path: str = "") -> list[str]:
    """Paths (from `path`, dot-separated) of the keywords of a JSON Schema that outlines-core's
    conversion to a regex does not encode (UNENFORCED anywhere; SHADOWED: dropped beside a
    sibling that wins), walking its subschemas (properties, items, anyOf, $defs, ...)."""
    if not isinstance(schema, dict):
        return []
    at = (lambda *k: ".".join((path, *k)) if path else ".".join(k))
    out = [at(k) for k in schema if k in UNENFORCED and not _encoded(schema, k)]
    shadowed = dict.fromkeys(d for k, drops in SHADOWED.items() if k in schema for d in drops if d in schema)
    out += [at(k) for k in shadowed]
    for k in _ONE:
        out += unenforced(schema.get(k), at(k))
    for k in _MAPS:
        if isinstance(schema.get(k), dict):
            for name, sub in schema[k].items():
                out += unenforced(sub, at(k, name))
    for k in _LISTS:
        if isinstance(schema.get(k), list):
            for i, sub in enumerate(schema[k]):
                out += unenforced(sub, at(k, str(i)))
    return out


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
