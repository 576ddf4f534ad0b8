"""Shared value checks of the frozen configs: byte sizes, coercion from dicts, layer ranges.

Every check raises InputError with the field's name, what it got and what is allowed."""

from __future__ import annotations

import math
import re
from dataclasses import fields

from ..errors import InputError

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_bytes(value: str | int | float | None, total: int | None = None) -> int | None:
    """'40GiB', '40GB', '512MB', '123B', an int (bytes) or a fraction 0 < f <= 1 of `total` (the
    card; '0.5' as a string too). A string number > 1 without a unit is refused (InputError)."""
    if value is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"memory size {value!r} is not a finite number; write e.g. '40GiB', '24GB' or 0.5")
    if isinstance(value, float) and 0 < value <= 1:
        if total is None:
            raise InputError(f"memory budget {value} is a fraction of the card, but there is no card")
        return int(value * total)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = _SIZE.match(value) if isinstance(value, str) else None
    if not m:
        raise InputError(f"cannot read memory size {value!r}; write e.g. '40GiB', '24GB' or 0.5")
    num, unit = float(m.group(1)), (m.group(2) or "").lower()
    if unit == "" and 0 < num <= 1:
        return parse_bytes(num, total)
    if unit == "" and num == 0:
        return 0
    if unit == "":  # '2' is far more likely a forgotten 'GiB' than two bytes
        raise InputError(f"memory size {value!r} has no unit; write e.g. '{value.strip()}GiB', "
                         f"'{value.strip()}GB', '{value.strip()}B' (bytes) or a fraction 0 < f <= 1 of the card")
    unit = unit if unit in _UNITS else unit + "b"
    return int(num * _UNITS[unit])



def coerce(cls, value):
    """A `cls` instance from None (the defaults), an instance, or a dict of its fields (an
    unknown key is an InputError listing the known ones)."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        known = {f.name for f in fields(cls)}
        bad = sorted(set(value) - known)
        if bad:
            raise InputError(f"unknown {cls.__name__} fields {bad}; known: {sorted(known)}")
        return cls(**value)
    article = "an" if cls.__name__[0] in "AEIOU" else "a"
    raise InputError(f"expected {article} {cls.__name__} or a dict, got {type(value).__name__}")


def is_int(value) -> bool:
    """A whole number that is not a bool (True is an int to Python, never to a config)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(owner: str, name: str, value, least: int, optional: bool = False) -> None:
    """InputError unless value is an int >= least (or None when optional)."""
    if optional and value is None:
        return
    if not is_int(value) or value < least:
        what = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise InputError(f"{owner}{name}={value!r} must be {what}{' or None' if optional else ''}")


def check_number(owner: str, name: str, value, optional: bool = False) -> None:
    """InputError unless value is a finite int or float (never a bool, NaN or infinity)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{owner}{name}={value!r} must be a finite number{' or None' if optional else ''}")


def check_choice(owner: str, name: str, value, allowed) -> None:
    if value not in allowed:
        raise InputError(f"{owner}{name}={value!r} is not one of {tuple(allowed)}")


def layer_range(owner: str, layers) -> tuple[int, int]:
    """(first, last) from a 2-list or tuple of layer indices, first <= last (InputError)."""
    lay = tuple(layers) if isinstance(layers, (list, tuple)) else ()
    if len(lay) != 2 or not all(is_int(i) and i >= 0 for i in lay) or lay[0] > lay[1]:
        raise InputError(f"{owner} layers={layers!r}: give [first, last] layer indices, first <= last")
    return lay


def disjoint_ranges(owner: str, ranges) -> None:
    """InputError when two ranges (objects with .layers) cover one layer."""
    seen: dict[int, int] = {}
    for i, r in enumerate(ranges):
        for layer in range(r.layers[0], r.layers[1] + 1):
            if layer in seen:
                raise InputError(f"{owner} ranges {seen[layer]} and {i} both cover layer {layer}")
            seen[layer] = i


def range_for(ranges, layer: int):
    """The range (with .layers) covering `layer`, or None."""
    for r in ranges:
        if r.layers[0] <= layer <= r.layers[1]:
            return r
    return None
