"""The paper's API words: EngineConfig aliases, max_seq_len at construction, inputs= and mask_ratio."""

import pytest
import torch
from conftest import bundled

from mosaic import EngineConfig, InputError, MosaicEngine
from mosaic.errors import MemoryBudgetError

PROMPT = "sort 31415926="


@pytest.fixture(scope="module")
def engine():
    bundled("tiny-llada")
    torch.set_num_threads(1)
    return MosaicEngine("tiny-llada", {"device": "cpu", "progress": False})


def test_the_papers_config_dict_is_accepted():
    cfg = EngineConfig.coerce({"max_seq_len": 524288, "chunking_strategy": "lazy", "logits_kernel": "mask_only"})
    assert cfg.max_length == cfg.max_seq_len == 524288
    assert cfg.chunks is None and cfg.logits_kernel == "auto" and not cfg.native


@pytest.mark.parametrize("value, chunks", [("lazy", None), ("none", (1, 1, 1)), ((2, 1, 3), (2, 1, 3)),
                                           ("2,2,2", (2, 2, 2))])
def test_chunking_strategy_words(value, chunks):
    assert EngineConfig(chunking_strategy=value).chunks == chunks


@pytest.mark.parametrize("fields, message", [
    (dict(chunking_strategy="eager"), "use 'lazy'"),
    (dict(chunking_strategy=(1, 2)), "three positive counts"),
    (dict(chunking_strategy="none", chunks=(2, 2, 2)), "contradicts"),
    (dict(logits_kernel="partial"), "mask_only"),
])
def test_bad_words_are_refused(fields, message):
    with pytest.raises(InputError, match=message):
        EngineConfig(**fields)


def test_max_seq_len_and_max_length_together_are_refused():
    with pytest.raises(InputError, match="not both"):
        EngineConfig.coerce({"max_seq_len": 8, "max_length": 8})


def test_full_logits_is_the_native_path_with_the_same_tokens(engine):
    full = MosaicEngine(engine.model, {"device": "cpu", "progress": False, "logits_kernel": "full"})
    assert full.config.native
    a = full.generate(PROMPT, max_new_tokens=8, steps=8)
    b = engine.generate(PROMPT, max_new_tokens=8, steps=8)
    assert a.path == "native" and b.path == "planned"
    assert torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("strategy", ["none", (2, 2, 2)])
def test_chunking_strategies_give_the_same_tokens(engine, strategy):
    other = MosaicEngine(engine.model, {"device": "cpu", "progress": False, "chunking_strategy": strategy})
    out = other.generate(PROMPT, max_new_tokens=8, steps=8)
    assert other.history[-1].chunks == ((1, 1, 1) if strategy == "none" else strategy)
    assert torch.equal(out.tokens, engine.generate(PROMPT, max_new_tokens=8, steps=8).tokens)


def test_max_seq_len_is_checked_against_the_budget_at_construction(engine):
    budget = engine.budget.fixed_bytes + 1_000_000
    with pytest.raises(MemoryBudgetError, match="max_seq_len 65,536 does not fit") as e:
        MosaicEngine(engine.model, {"device": "cpu", "memory_budget": budget, "max_seq_len": 65536})
    assert 0 < e.value.max_tokens < 65536 and e.value.needed_bytes > budget
    ok = MosaicEngine(engine.model, {"device": "cpu", "progress": False, "memory_budget": budget,
                                     "max_seq_len": e.value.max_tokens})
    assert ok.config.max_seq_len == e.value.max_tokens


def test_max_seq_len_is_the_admission_limit(engine):
    small = MosaicEngine(engine.model, {"device": "cpu", "progress": False, "max_seq_len": 20})
    assert small.generate(PROMPT, max_new_tokens=4, steps=4).steps == 4     # 15 + 4 tokens
    with pytest.raises(InputError, match="exceeds max_length 20"):
        small.generate(PROMPT, max_new_tokens=8, steps=8)


def test_inputs_is_the_prompt(engine):
    a = engine.generate(inputs=PROMPT, max_new_tokens=8, steps=8)
    assert a.text == engine.generate(PROMPT, max_new_tokens=8, steps=8).text == "11234569"
    with pytest.raises(InputError, match="once"):
        engine.generate(PROMPT, inputs=PROMPT)
    with pytest.raises(InputError, match="needs a prompt"):
        engine.generate(max_new_tokens=8)


def test_mask_ratio_sizes_the_canvas_and_changes_nothing_else(engine):
    P = len(engine.encode(PROMPT)[0])          # 15 tokens
    out = engine.generate(inputs=PROMPT, mask_ratio=0.6, steps=8)
    G = int(0.6 * P / 0.4)                      # 22: 22 / (15 + 22) = 0.59 <= 0.6
    assert out.config.max_new_tokens == G == 22
    same = engine.generate(PROMPT, max_new_tokens=G, steps=8)
    assert torch.equal(out.tokens, same.tokens)


def test_mask_ratio_is_capped_by_max_new_tokens_and_rounded_to_blocks(engine):
    capped = engine.generate(inputs=PROMPT, max_new_tokens=8, mask_ratio=0.6, steps=8)
    assert capped.config.max_new_tokens == 8 and capped.text == "11234569"
    blocks = engine.generate(inputs=PROMPT, mask_ratio=0.6, block_length=4, steps=10)
    assert blocks.config.max_new_tokens == 20     # 22 rounded down to a multiple of 4


@pytest.mark.parametrize("ratio, message", [(0.0, r"in \(0, 1\)"), (1.0, r"in \(0, 1\)"), (True, r"in \(0, 1\)"),
                                            (0.01, "leaves a canvas of 0 tokens")])
def test_bad_mask_ratio(engine, ratio, message):
    with pytest.raises(InputError, match=message):
        engine.generate(PROMPT, mask_ratio=ratio)
