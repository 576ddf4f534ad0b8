"""config/int_range.py: the regex of an integer range matches exactly the integers of the range
in canonical form (brute force over a window), bounds are read as JSON Schema defines them, and
the rewrite goes through outlines-core's conversion to the range's regex in place."""

from __future__ import annotations

import json
import math
import re

import pytest

from mosaic.config.int_range import bounds, fill, integers, rewrite
from mosaic.errors import InputError

INF = math.inf
RANGES = [(0, 10), (1000, INF), (-INF, 10), (-INF, -5), (-7, INF), (-123, 4567), (5, 5), (0, 0), (-1, -1),
          (10, 99), (19, 2001), (-INF, INF), (-INF, 0), (1, INF), (-2617, -548), (-309, 916), (398, 399)]


@pytest.mark.parametrize("lo, hi", RANGES)
def test_the_range_regex_is_exact(lo, hi):
    rx = re.compile(f"(?:{integers(lo, hi)})")
    wrong = [n for n in range(-3000, 5000) if bool(rx.fullmatch(str(n))) != (lo <= n <= hi)]
    assert not wrong, wrong[:5]
    assert not any(rx.fullmatch(s) for s in ("-0", "007", "01", "-01", "", "-"))
    assert bool(rx.fullmatch("123456789012")) == (hi == INF) and bool(rx.fullmatch("-123456789012")) == (lo == -INF)


def test_bounds_follow_json_schema():
    assert bounds({"type": "integer", "minimum": 1.5, "maximum": 9.5}) == (2, 9)
    assert bounds({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 7}) == (4, 6)
    assert bounds({"type": "integer", "exclusiveMinimum": 2.5}) == (3, INF)
    for uncovered in ({"type": "number", "maximum": 3}, {"type": ["integer", "null"], "maximum": 3},
                      {"type": "integer", "exclusiveMaximum": True, "maximum": 3}, {"type": "integer"},
                      {"type": "integer", "maximum": 10**20}, {"type": "integer", "enum": [1], "maximum": 3}):
        assert bounds(uncovered) is None, uncovered


def test_rewrite_through_outlines_core():
    js = pytest.importorskip("outlines_core.json_schema")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 12},
                                               "m": {"type": "array", "items": {"type": "integer", "maximum": -1}}},
              "required": ["n", "m"]}
    out, found = rewrite(schema)
    rx = re.compile(fill(js.build_regex_from_schema(json.dumps(out), r"[ ]?"), found))
    assert rx.fullmatch('{"n":12,"m":[-1,-40]}') and rx.fullmatch('{"n":3,"m":[]}')
    assert not rx.fullmatch('{"n":13,"m":[]}') and not rx.fullmatch('{"n":5,"m":[0]}')
    with pytest.raises(InputError, match="no integer fits the bounds at properties.n"):
        rewrite({"properties": {"n": {"type": "integer", "minimum": 3, "exclusiveMaximum": 3}}})
