"""What tensor parallelism combines with (policy/features.py): block caches, seeded sampling,
self-speculation and batch_invariant run; native, sparse, offload, FP8 and unseeded draws are
refused."""

import pytest

from mosaic.config import EngineConfig, GenerationConfig
from mosaic.errors import InputError
from mosaic.policy.features import Setting, refuse


def setting(config=None, tensor=2, **gen):
    return Setting(EngineConfig(**(config or {})), GenerationConfig(**gen), "llada", draws="seed" not in gen
                   and gen.get("temperature", 0) > 0, tensor=tensor, native=(config or {}).get("native", False))


@pytest.mark.parametrize("config, gen", [({}, {"cache": "dual", "block_length": 4}),
                                         ({}, {"cache": "prefix", "block_length": 4}),
                                         ({}, {"temperature": 0.7, "seed": 1}),
                                         ({}, {"speculate": 2}),
                                         ({"batch_invariant": True}, {})])
def test_supported(config, gen):
    refuse(setting(config, **gen))


@pytest.mark.parametrize("config, gen, words", [
    ({"native": True}, {}, "native path runs on one process"),
    ({"sparse": {"ranges": [{"layers": [0, 1], "pattern": "topk", "keep": 0.5}]}}, {}, "block-sparse attention"),
    ({"offload": "weights"}, {}, "offload is not available under tensor parallelism"),
    ({"precision": {"ranges": [{"layers": [0, 1], "dtype": "fp8"}]}}, {}, "FP8 weights"),
    ({}, {"temperature": 0.7}, "pass seed=N"),
])
def test_refused_with_one_clear_message(config, gen, words):
    with pytest.raises(InputError, match=words):
        refuse(setting(config, **gen))


def test_the_refusals_are_tensor_parallel_ones():
    refuse(setting({"offload": "weights"}, tensor=1))     # one process offloads
    refuse(setting({"precision": {"ranges": [{"layers": [0, 1], "dtype": "fp8"}]}}, tensor=1))


def test_a_16_bit_tensor_parallel_request_is_labelled():
    import torch
    from conftest import random_model

    from mosaic.policy.features import lossy_labels
    from mosaic.runtime.samplers import sampler_for
    fp32, bf16 = random_model("llada"), random_model("llada", dtype=torch.bfloat16)
    sampler = sampler_for(fp32.cfg)
    label = [x for x in lossy_labels(setting(), bf16, sampler) if x.startswith("tensor parallelism")]
    assert label and "float32, rank order" in label[0]
    assert not [x for x in lossy_labels(setting(), fp32, sampler) if x.startswith("tensor parallelism")]
    assert not [x for x in lossy_labels(setting(tensor=1), bf16, sampler) if x.startswith("tensor parallelism")]
