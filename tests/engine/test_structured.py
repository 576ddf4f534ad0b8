"""Structured output through the engine (docs/STRUCTURED.md): every family's samplers on random
byte-level checkpoints (their answers parse and validate), the bundled models' answers under a
constraint that admits them, the refusals, the labels."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import bundled
from pydantic import BaseModel

from bench.lib.byte_models import byte_checkpoint
from mosaic import MosaicEngine
from mosaic.assets import tasks
from mosaic.errors import InputError

pytest.importorskip("outlines_core")


class Owner(BaseModel):
    id: int
    active: bool


class Pet(BaseModel):
    name: str
    kind: str
    age: int
    weight: float
    tags: list[str]
    owner: Owner


SCHEMA = Pet.model_json_schema() | {"properties": Pet.model_json_schema()["properties"] | {
    "kind": {"enum": ["cat", "dog", "bird"]}}}

CASES = [("llada", dict(steps=48, block_length=32)), ("llada", dict(cache="dual", threshold=0.9, block_length=32)),
         ("dream", dict(threshold=0.9, steps=48)), ("dream", dict(cache="prefix", threshold=0.9, block_length=32)),
         ("llada2", dict(block_length=32)), ("llada_moe", dict(threshold=0.7, steps=48))]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("byte")
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = MosaicEngine(str(byte_checkpoint(family, root / family, 0)),
                                         {"device": "cpu", "progress": False})
        return cache[family]
    return get


@pytest.mark.parametrize("family,opts", CASES, ids=[f"{f}-{'-'.join(map(str, o.values()))}" for f, o in CASES])
def test_random_checkpoints_answer_valid_json(engines, family, opts):
    out = engines(family).generate("hi", max_new_tokens=96, json_schema=SCHEMA, seed=3, **opts)
    pet = Pet.model_validate_json(out.text)
    assert pet.kind in ("cat", "dog", "bird")
    assert any(label.startswith("structured:") for label in out.lossy)
    assert out.stats["structured"]["complete"]


def test_regex_and_choice_on_random_checkpoints(engines):
    e = engines("dream")
    out = e.generate(["a", "bb"], max_new_tokens=12, regex=r"[a-f]{2}-[0-9]{1,3}", steps=12, seed=1)
    import re
    assert all(re.fullmatch(r"[a-f]{2}-[0-9]{1,3}", t) for t in out.texts), out.texts
    out = e.generate("x", max_new_tokens=6, choice=["yes", "no", "maybe"], steps=6)
    assert out.text in ("yes", "no", "maybe")


def test_bundled_answers_unchanged_when_the_constraint_admits_them():
    e = MosaicEngine(bundled("tiny-llada"), {"device": "cpu", "progress": False})
    prompts = tasks.held_out(3)[::4][:6]
    free = e.generate(prompts, max_new_tokens=tasks.ANSWER_LEN, steps=tasks.ANSWER_LEN)
    regex = e.generate(prompts, max_new_tokens=tasks.ANSWER_LEN, steps=tasks.ANSWER_LEN, regex="[0-9]{1,8}")
    assert regex.texts == free.texts
    for p in prompts[:2]:
        right = tasks.solve(p)
        out = e.generate(p, max_new_tokens=tasks.ANSWER_LEN, steps=tasks.ANSWER_LEN, choice=[right, right + "1", "7"])
        assert out.text == right
    forced = e.generate("57+384=", max_new_tokens=8, steps=8, regex="9[0-9]{2}")
    assert forced.text.startswith("9") and len(forced.text) == 3


def test_refusals_before_any_work():
    e = MosaicEngine(bundled("tiny-llada"), {"device": "cpu", "progress": False})
    with pytest.raises(InputError, match="planned path"):
        e.generate("sort 12=", max_new_tokens=8, regex="[0-9]+", native=True)
    with pytest.raises(InputError, match="speculat"):
        e.generate("sort 12=", max_new_tokens=8, regex="[0-9]+", speculate=2)
    with pytest.raises(InputError, match="one output constraint"):
        e.generate("sort 12=", max_new_tokens=8, regex="[0-9]+", choice=["1"])
    with pytest.raises(InputError, match="more than max_tokens 2"):
        e.generate("sort 12=", max_new_tokens=2, regex="[0-9]{3}")
    with pytest.raises(InputError, match="cannot be compiled"):
        e.generate("sort 12=", max_new_tokens=8, json_schema={"type": "object", "properties": {"a": {"type": "x"}}})
    assert e.history == [] if hasattr(e, "history") and isinstance(e.history, list) else True


def test_missing_library_is_one_clear_error(monkeypatch):
    e = MosaicEngine(bundled("tiny-llada"), {"device": "cpu", "progress": False})
    monkeypatch.setitem(sys.modules, "outlines_core", None)
    e.requests.compiler._cache.clear()
    with pytest.raises(InputError, match=r"pip install 'mosaic-dllm\[structured\]'"):
        e.generate("sort 12=", max_new_tokens=8, regex="[0-9]{2,3}")


def test_response_format_shapes():
    e = MosaicEngine(bundled("tiny-llada"), {"device": "cpu", "progress": False})
    out = e.generate("sort 321=", max_new_tokens=8, steps=8,
                     response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": [123]}}})
    assert json.loads(out.text) == 123
