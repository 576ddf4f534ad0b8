"""Integer bounds of a JSON Schema as a regex, so that the grammar enforces them exactly.

outlines-core's schema-to-regex conversion reads `{"type": "integer", "minimum": 1000}` as any
integer (config/structured.UNENFORCED). `rewrite` replaces each such subschema by a placeholder
string constant before the conversion and `fill` puts the range's regex in its place after it:
the answer is then an integer of the range, in JSON's canonical form (no leading zeros, no -0).
Covered: `"type": "integer"` with `minimum` / `maximum` / `exclusiveMinimum` /
`exclusiveMaximum` given as numbers of magnitude below 10^18 (fractional bounds rounded inwards).
Not covered (left to UNENFORCED's label): `multipleOf`, `"type": "number"`, a type list, Draft 4's
boolean exclusive bounds, and a subschema with `enum` / `const` (which win anyway).

The range's regex is the textbook digit-by-digit construction (as in Python's `regex-range`
recipes): split by digit count, then per leading digit."""

from __future__ import annotations

import math

from ..errors import InputError

BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
LIMIT = 10**18          # larger bounds stay unenforced (and named): their regexes grow with the digits
_ONE = ("items", "additionalProperties", "not", "unevaluatedProperties", "unevaluatedItems")
_MAPS = ("properties", "$defs", "definitions")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def bounds(schema) -> tuple[float, float] | None:
    """(lo, hi) inclusive integer bounds (-inf / inf when open) of a subschema `rewrite` covers,
    else None."""
    if not isinstance(schema, dict) or schema.get("type") != "integer" or "enum" in schema or "const" in schema:
        return None
    given = {k: schema[k] for k in BOUNDS if k in schema}
    if not given or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < LIMIT
                            for v in given.values()):
        return None
    ends = {"minimum": math.ceil, "exclusiveMinimum": lambda v: math.floor(v) + 1,
            "maximum": math.floor, "exclusiveMaximum": lambda v: math.ceil(v) - 1}
    inclusive = {k: ends[k](v) for k, v in given.items()}
    lo = max((inclusive[k] for k in ("minimum", "exclusiveMinimum") if k in inclusive), default=-math.inf)
    hi = min((inclusive[k] for k in ("maximum", "exclusiveMaximum") if k in inclusive), default=math.inf)
    return lo, hi


def rewrite(schema, path: str = "", found: dict | None = None, tag: str = "mosaicintrange") \
        -> tuple[object, dict[str, str]]:
    """(schema with each bounded integer subschema replaced by {"const": a placeholder}, {the
    placeholder: its range's regex}); tag: the placeholders' prefix (text the schema does not
    hold). InputError when no integer fits a subschema's bounds."""
    found = {} if found is None else found
    b = bounds(schema)
    if b is not None:
        if b[0] > b[1]:
            raise InputError(f"no integer fits the bounds at {path or 'the root'} "
                             f"({', '.join(f'{k} {schema[k]}' for k in BOUNDS if k in schema)})")
        key = f"{tag}{len(found)}x"
        found[key] = integers(*b)
        return {"const": key}, found
    if not isinstance(schema, dict):
        return schema, found
    at = (lambda *k: ".".join((path, *k)) if path else ".".join(k))
    out = dict(schema)
    for k in _ONE:
        if k in out:
            out[k] = rewrite(out[k], at(k), found, tag)[0]
    for k in (m for m in _MAPS if isinstance(out.get(m), dict)):
        out[k] = {name: rewrite(sub, at(k, name), found, tag)[0] for name, sub in out[k].items()}
    for k in (m for m in _LISTS if isinstance(out.get(m), list)):
        out[k] = [rewrite(sub, at(k, str(i)), found, tag)[0] for i, sub in enumerate(out[k])]
    return out, found


def fill(regex: str, found: dict[str, str]) -> str:
    """The converted regex with each placeholder constant replaced by its range's regex."""
    for key, rx in found.items():
        regex = regex.replace(f'"{key}"', f"({rx})")
    return regex


def integers(lo: float, hi: float) -> str:
    """A regex of the integers in [lo, hi] (each end an int or +-inf) in canonical form."""
    parts = []
    if lo < 0:
        parts += ["-(" + naturals(max(1, -hi), -lo) + ")"] if min(hi, -1) >= lo else []
    if hi >= 0:
        parts.append(naturals(max(lo, 0), hi))
    return "|".join(parts)


def naturals(a: int, b: float) -> str:
    """A regex of the integers in [a, b], 0 <= a <= b (b may be inf), no leading zeros."""
    parts = []
    if a == 0:
        parts.append("0")
        a = 1
    if a <= b:
        top = len(str(a)) if b == math.inf else len(str(int(b)))
        for n in range(len(str(a)), top + 1):
            x = max(a, 10 ** (n - 1))
            y = 10 ** n - 1 if b == math.inf else min(int(b), 10 ** n - 1)
            if x <= y:
                parts.append(same(str(x), str(y)))
        if b == math.inf:
            parts.append(f"[1-9][0-9]{{{top},}}")
    return "|".join(parts)


def same(x: str, y: str) -> str:
    """A regex of the numbers from x to y, digit strings of one length, x <= y."""
    if x == y:
        return x
    if x == "0" * len(x) and y == "9" * len(y):
        return f"[0-9]{{{len(x)}}}" if len(x) > 1 else "[0-9]"
    if len(x) == 1:
        return f"[{x}-{y}]"
    if x[0] == y[0]:
        return x[0] + "(" + same(x[1:], y[1:]) + ")"
    rest = len(x) - 1
    parts = [x[0] + "(" + same(x[1:], "9" * rest) + ")"]
    if int(x[0]) + 1 <= int(y[0]) - 1:
        parts.append(f"[{int(x[0]) + 1}-{int(y[0]) - 1}][0-9]{{{rest}}}")
    parts.append(y[0] + "(" + same("0" * rest, y[1:]) + ")")
    return "|".join(parts)
