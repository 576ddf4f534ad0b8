"""Structured output on the GPU (docs/STRUCTURED.md): every family's constrained answers parse on
CUDA (masks built on the device, the window's logits on the buffer path, no graph captured for a
constrained step), and the bundled model's answers equal the unconstrained ones when the
constraint admits them. Skipped without CUDA.

    python -m pytest -q -m gpu tests/gpu/test_structured_gpu.py"""

import json

import pytest
from conftest import bundled, needs_cuda

from bench.lib.byte_models import byte_checkpoint
from mosaic import MosaicEngine
from mosaic.assets import tasks

pytestmark = [pytest.mark.gpu, needs_cuda]
pytest.importorskip("outlines_core")

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {
    "enum": ["a", "b"]}}, "ok": {"type": "boolean"}}, "required": ["id", "tags", "ok"]}


@pytest.mark.parametrize("family,opts", [("llada", dict(steps=64, block_length=32)),
                                         ("llada", dict(cache="dual", threshold=0.9, block_length=32)),
                                         ("dream", dict(steps=64)), ("llada2", dict(block_length=32))])
def test_constrained_answers_parse_on_cuda(tmp_path, family, opts):
    e = MosaicEngine(str(byte_checkpoint(family, tmp_path / family, 0)), {"device": "cuda", "progress": False})
    for seed in range(3):
        out = e.generate(["x", "yy"], max_new_tokens=64, json_schema=SCHEMA, seed=seed, **opts)
        for text in out.texts:
            obj = json.loads(text)
            assert set(obj) == {"id", "tags", "ok"} and all(t in ("a", "b") for t in obj["tags"])


def test_bundled_answers_unchanged_on_cuda():
    e = MosaicEngine(bundled("tiny-llada"), {"device": "cuda", "progress": False})
    prompts = tasks.held_out(2)[::2]
    free = e.generate(prompts, max_new_tokens=tasks.ANSWER_LEN, steps=tasks.ANSWER_LEN)
    got = e.generate(prompts, max_new_tokens=tasks.ANSWER_LEN, steps=tasks.ANSWER_LEN, regex="[0-9]{1,8}")
    assert got.texts == free.texts
