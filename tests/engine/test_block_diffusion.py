"""LLaDA2.x block diffusion through the engine: tokens identical to the published generate()
(a plain re-implementation: tests/plain_families.py) on tiny random checkpoints, CPU float32,
alone and in left-padded batches (each sequence as its own run), with an exact block K/V cache."""

import json

import pytest
import torch
from plain_families import TINY_LLADA2, llada2_forward, llada2_generate, llada2_keys, random_state
from safetensors.torch import save_file

from mosaic import MosaicEngine, load
from mosaic.errors import InputError, MemoryBudgetError
from mosaic.runtime.block_canvas import block_canvas

EOS, MASK = 45, 47


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llada2")
    sd = random_state(llada2_keys(TINY_LLADA2), 1)
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(TINY_LLADA2))
    return folder, sd


def official(sd, prompt, **kw):
    fwd = lambda ids, m, pos: llada2_forward(sd, TINY_LLADA2, ids, m, pos)  # noqa: E731
    return llada2_generate(fwd, torch.tensor([prompt]), eos_id=EOS, mask_id=MASK, **kw).tolist()


def cut(tokens):
    t = tokens.tolist()
    return t[: t.index(EOS) + 1] if EOS in t else t


def prompt_of(n, seed):
    return torch.randint(0, 44, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CASES = [dict(gen_length=12, block_length=4, steps=4),
         dict(gen_length=10, block_length=4, steps=2, threshold=0.3),
         dict(gen_length=9, block_length=4, steps=4, threshold=0.9),
         dict(gen_length=16, block_length=8, steps=3, threshold=0.5),
         dict(gen_length=7, block_length=3, steps=7, threshold=1.0)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_tokens_equal_published_generate(ckpt, case):
    folder, sd = ckpt
    engine = MosaicEngine(load(folder, device="cpu", dtype="float32"), {"progress": False, "sanitize": True})
    for n, seed in ((5, 0), (8, 1), (1, 2)):
        p = prompt_of(n, seed)
        kw = dict(max_new_tokens=case["gen_length"], block_length=case["block_length"], steps=case["steps"],
                  threshold=case.get("threshold"))
        got = engine.generate([p], **kw)
        ref = official(sd, p, **{k: v for k, v in case.items() if k != "threshold"},
                       threshold=case.get("threshold", 0.95))
        assert cut(got.tokens[0]) == ref, (n, case)


def test_left_padded_batch_equals_each_alone(ckpt):
    folder, sd = ckpt
    engine = MosaicEngine(load(folder, device="cpu", dtype="float32"), {"progress": False})
    ps = [prompt_of(n, 10 + n) for n in (2, 9, 5, 13)]
    got = engine.generate(ps, max_new_tokens=11, block_length=4, steps=3, threshold=0.6)
    for b, p in enumerate(ps):
        assert cut(got.tokens[b]) == official(sd, p, gen_length=11, block_length=4, steps=3, threshold=0.6)
    assert got.stats["kv_tier"] == "device" and got.stats["nfe"] > 0


def test_cache_computes_each_finished_block_once(ckpt):
    """Every step runs its block plus the blocks finished since the last step: the rows run per
    step are (first step) the prompt and its block, then at most two blocks."""
    folder, _ = ckpt
    engine = MosaicEngine(load(folder, device="cpu", dtype="float32"), {"progress": False})
    engine.generate([prompt_of(9, 3)], max_new_tokens=12, block_length=4, steps=4, threshold=1.0)
    lengths = [h.key[1] for h in engine.history]
    assert lengths[0] == 12 and all(n in (4, 8) for n in lengths[1:]), lengths


def test_canvas_aligns_blocks():
    c = block_canvas([[1, 2], [1, 2, 3, 4, 5, 6]], 5, 4, MASK, 0)
    assert c.width == 12 and c.pads == (4, 0) and [c.first_block(b) for b in range(2)] == [1, 1]
    assert c.standard(0)[0].tolist()[:6] == [0, 0, 0, 0, 1, 2]


@pytest.mark.filterwarnings("ignore:prompt")
def test_refusals_before_work(ckpt):
    folder, _ = ckpt
    engine = MosaicEngine(load(folder, device="cpu", dtype="float32"), {"progress": False})
    with pytest.raises(InputError, match="planned path"):
        engine.generate([[1, 2]], max_new_tokens=4, native=True)
    with pytest.raises(InputError, match="cache"):
        engine.generate([[1, 2]], max_new_tokens=4, cache="dual")
    small = MosaicEngine(load(folder, device="cpu", dtype="float32"), {"progress": False, "memory_budget": "340MiB"})
    with pytest.raises(MemoryBudgetError, match="longest that fits"):
        small.generate([[1] * 40], max_new_tokens=200_000, block_length=4)


def test_plan_and_admission_agree(ckpt):
    """`mosaic plan` (capacity_report on this CPU) and run-time admission of a request with half
    its tokens generated: L_max is admitted, L_max + 1024 refused, before anything is allocated."""
    from mosaic import GenerationConfig
    from mosaic.memory.accounting import FIXED_BYTES
    from mosaic.policy.capacity import capacity_report
    folder, _ = ckpt
    model = load(folder, device="cpu", dtype="float32")
    budget = model.weight_bytes() + FIXED_BYTES + 6 * 2**20
    rep = capacity_report(model, budget, context_bytes=0, target="cpu", ratios=(1.0,))
    L = rep["l_max"]
    assert L >= 1024 and rep["kv_cache_bytes_per_token"] == 2 * 3 * 16 * 4
    # plan's default keeps the store on the device; the engine's kv_tier auto would split it
    engine = MosaicEngine(model, {"progress": False, "memory_budget": budget, "kv_tier": "device"})
    gen = GenerationConfig(max_new_tokens=L // 2, block_length=32)
    adm = engine.admit(1, L, gen)                     # the engine's Admitter, as every request
    layout = adm.layout
    assert layout.length == L and adm.predicted_bytes <= budget
    with pytest.raises(MemoryBudgetError) as e:
        engine.admit(1, L + 1024, GenerationConfig(max_new_tokens=L // 2 + 512))
    assert L <= e.value.max_tokens < L + 1024
