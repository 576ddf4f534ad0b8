"""Helpers of the serve tests: a budgeted tiny-llada engine, SSE parsing. (Not a conftest.py: the
tests import the top-level conftest by name.)"""

import json

import pytest
import torch

from mosaic.loader import BUNDLED

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from mosaic import MosaicEngine  # noqa: E402

# activations the budget leaves beyond weights + fixed workspace: ~420 tokens of tiny-llada
ACTIVATION_BYTES = 1_000_000
# the servers of these tests accept requests past tiny-llada's trained 64 tokens (--max-model-len),
# so that the memory budget is what refuses long ones; test_max_model_len.py tests the default rule
PAST_TRAINED = 4096


def budgeted_engine(**config) -> MosaicEngine:
    if not (BUNDLED["tiny-llada"] / "model.safetensors").exists():
        pytest.skip("bundled model tiny-llada is not trained yet")
    torch.set_num_threads(1)   # 2 shared cores: one BLAS thread is faster than two fighting
    base = MosaicEngine("tiny-llada", {"device": "cpu", "progress": False})
    return MosaicEngine(base.model, {"device": "cpu", "progress": False,
                                     "memory_budget": base.budget.fixed_bytes + ACTIVATION_BYTES, **config})


def events(response):
    """The data payloads of an SSE response, in order ('[DONE]' kept as a string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
