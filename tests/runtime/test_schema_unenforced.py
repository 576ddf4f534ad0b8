"""The JSON Schema keywords outlines-core's schema-to-regex conversion does not encode
(config/structured.UNENFORCED, SHADOWED) are named, never silently dropped: each listed keyword
is checked against the library (the regex with it equals the regex without it), the walk reaches
nested subschemas and not property names, and a generate() answer that breaks a bound carries
the keyword in its label and statistics."""

from __future__ import annotations

import json

import pytest

from mosaic.config.structured import UNENFORCED, spec_of, unenforced

oc = pytest.importorskip("outlines_core")
import outlines_core.json_schema  # noqa: E402

# a schema per keyword where the keyword is meaningful: (the schema with it, the keyword's value)
BASE = {"integer": {"type": "integer"}, "number": {"type": "number"},
        "array": {"type": "array", "items": {"type": "integer"}},
        "object": {"type": "object", "additionalProperties": {"type": "integer"}},
        "string": {"type": "string"}, "fixed": {"type": "object", "properties": {"a": {"type": "integer"}}}}
CASES = {"minimum": ("number", 1000), "maximum": ("number", 10), "exclusiveMinimum": ("number", 3),
         "exclusiveMaximum": ("number", 3), "multipleOf": ("integer", 7), "uniqueItems": ("array", True),
         "contains": ("array", {"const": 1}), "minContains": ("array", 2), "maxContains": ("array", 2),
         "minProperties": ("fixed", 1), "maxProperties": ("object", 1),
         "propertyNames": ("object", {"pattern": "^a$"}), "patternProperties": ("object", {"^a": {"type": "string"}}),
         "dependentRequired": ("object", {"a": ["b"]}), "dependentSchemas": ("object", {"a": {"required": ["b"]}}),
         "if": ("integer", {"minimum": 1}), "then": ("integer", {"maximum": 3}), "else": ("integer", {"maximum": 9}),
         "contentEncoding": ("string", "base64"), "contentMediaType": ("string", "text/plain"),
         "contentSchema": ("string", {"type": "integer"})}


def regex(schema) -> str:
    return outlines_core.json_schema.build_regex_from_schema(json.dumps(schema), r"[ ]?")


@pytest.mark.parametrize("keyword", UNENFORCED)
def test_each_listed_keyword_changes_nothing_in_the_regex(keyword):
    kind, value = CASES[keyword]
    schema = BASE[kind] | {keyword: value}
    assert regex(schema) == regex(BASE[kind]), f"outlines-core now encodes {keyword}: drop it from UNENFORCED"
    assert unenforced(schema) == [keyword]


@pytest.mark.parametrize("schema, dropped", [
    ({"type": "string", "pattern": "a+", "minLength": 3}, "pattern"),
    ({"type": "string", "format": "date", "maxLength": 3}, "format"),
    ({"type": "string", "pattern": "a+", "format": "date"}, "format"),
    ({"enum": ["a", "bb"], "maxLength": 1}, "maxLength"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "integer"}, "minItems": 2},
     "minItems"),
])
def test_a_shadowed_keyword_is_named(schema, dropped):
    without = {k: v for k, v in schema.items() if k != dropped}
    assert regex(schema) == regex(without)
    assert unenforced(schema) == [dropped]


def test_min_properties_is_named_where_it_is_not_encoded():
    free = BASE["object"]
    assert regex(free | {"minProperties": 1}) != regex(free) and unenforced(free | {"minProperties": 1}) == []
    assert regex(free | {"minProperties": 2}) == regex(free | {"minProperties": 1})    # 2 still allows one
    assert unenforced(free | {"minProperties": 2}) == ["minProperties"]


def test_enforced_keywords_are_not_named():
    for schema in ({"type": "string", "minLength": 3}, {"type": "string", "pattern": "a+"},
                   {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
                   {"type": "string", "format": "date"}):
        bare = {k: v for k, v in schema.items() if k in ("type", "items")}
        assert regex(schema) != regex(bare)
        assert unenforced(schema) == []


def test_the_walk_reaches_subschemas_and_not_property_names():
    schema = {"type": "object", "properties": {"maximum": {"type": "integer"},
                                               "n": {"type": "array", "items": {"type": "number", "minimum": 1}}},
              "$defs": {"p": {"anyOf": [{"type": "integer", "multipleOf": 2}, {"type": "null"}]}}}
    assert unenforced(schema) == ["properties.n.items.minimum", "$defs.p.anyOf.0.multipleOf"]
    assert unenforced(schema, "guided_json") == ["guided_json.properties.n.items.minimum",
                                                 "guided_json.$defs.p.anyOf.0.multipleOf"]
    assert spec_of(regex="[0-9]+").unenforced() == []


def test_integer_bounds_are_enforced_and_not_named():
    """outlines-core drops an integer's bounds (the regex equals the bare one), Mosaic's rewrite
    (config/int_range.py) encodes them, so they are not named; a number's bounds still are."""
    assert regex({"type": "integer", "maximum": 10}) == regex({"type": "integer"})
    for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        assert unenforced({"type": "integer", k: 3}) == []
    assert unenforced({"type": "integer", "maximum": 3, "multipleOf": 2}) == ["multipleOf"]
    assert unenforced({"type": ["integer", "null"], "maximum": 3}) == ["maximum"]


def engine():
    from conftest import bundled

    from mosaic import MosaicEngine
    return MosaicEngine(str(bundled("tiny-llada")), {"device": "cpu", "progress": False})


def test_generate_labels_a_bound_it_did_not_enforce():
    out = engine().generate("57+384=", max_new_tokens=8, json_schema={"type": "number", "maximum": 10})
    label = next(label for label in out.lossy if label.startswith("structured:"))
    assert "not enforced" in label and "maximum" in label, label
    assert out.stats["structured"]["unenforced"] == ["maximum"]


def test_generate_keeps_an_integer_in_its_bounds():
    """tiny-llada answers 57+384= with 441 free; under maximum 10 (or minimum 1000) the answer
    is an integer of the range and nothing is labelled as not enforced."""
    e = engine()
    for schema, fits in (({"type": "integer", "maximum": 10}, lambda n: n <= 10),
                         ({"type": "integer", "minimum": 1000}, lambda n: n >= 1000),
                         ({"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3}, lambda n: -3 < n < 3)):
        out = e.generate("57+384=", max_new_tokens=8, json_schema=schema)
        assert fits(json.loads(out.texts[0])), (schema, out.texts)
        assert out.stats["structured"]["unenforced"] == [] and "not enforced" not in " ".join(out.lossy)
