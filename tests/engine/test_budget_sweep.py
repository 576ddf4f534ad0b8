"""Admission and execution agree near the budget: a request admitted under a budget never fails
at one of its steps with MemoryBudgetError, for every family's sampler, greedy and sampled.

For each case the smallest budget that admits the request is found by bisection over
`engine.admit`; then the request runs at that budget and at budgets above it. Before the chunk
search grew the phase holding the out-of-plan peak (policy/chunking._grow_to_fit) and block
admission probed every kind of step that runs (policy/block_admission.step_rows), a sampled
LLaDA2 request at 44 of 56 such budgets was admitted and then refused at its first one-block
step ("the plan needs 0.3 MiB with chunks (32, 4, 11)": attention grown to 32 chunks of a step
that has one block)."""

import pytest
from conftest import random_model

from mosaic import MosaicEngine
from mosaic.errors import MemoryBudgetError
from mosaic.memory.accounting import FIXED_BYTES

PROMPT = list(range(10, 20))   # no family's special ids (iLLaDA's mask is 5)
# the LLaDA2 geometry of the failure (a 256-wide model, a 2,048-token vocabulary: the sampling
# reducer's logits transient is then as large as a one-block step's attention)
LLADA2 = dict(vocab=2048, hidden=256, head_dim=64, mask_id=2047, eos_id=2045, pad_id=2045, ffn=512)
SAMPLED = dict(temperature=1.0, seed=1)


def smallest_budget(model, kw) -> int:
    """A budget (bytes) at the edge of admitting the request: from the weights' and workspace's
    bytes up, each refusal's needed_bytes (or, where that names one phase's bytes only, a step
    doubling each time) is the next budget tried, until one admits."""
    budget, step = model.weight_bytes() + FIXED_BYTES + 1, 4096
    for _ in range(40):
        if admitted(model, budget, kw) is not None:
            return budget
        budget, step = max(budget + step, REFUSALS[-1]), step * 2
    raise AssertionError(f"no budget up to {budget} admits {kw}")


REFUSALS = [0]   # the needed_bytes of the last refusal


def admitted(model, budget: int, kw) -> MosaicEngine | None:
    engine = MosaicEngine(model, {"progress": False, "memory_budget": budget})
    try:
        engine.admit(1, len(PROMPT) + kw["max_new_tokens"], engine.generation_config(**kw))
    except MemoryBudgetError as e:
        REFUSALS.append(e.needed_bytes)
        return None
    return engine


def sweep(model, kw, offsets) -> list:
    """(offset, error) of every budget above the smallest admitted one whose admitted request
    failed while it ran."""
    least = smallest_budget(model, kw)
    failures = []
    for off in offsets:
        engine = admitted(model, least + off, kw)
        assert engine is not None or off < 0, f"admitted at {least} bytes but not at {least + off}"
        if engine is None:
            continue
        try:
            engine.generate(PROMPT, **kw)
        except MemoryBudgetError as e:
            failures.append((off, str(e)))
    return failures


def runs_what_it_admits(model, kw, budgets) -> tuple[int, list]:
    """(how many of `budgets` admitted the request, (budget, error) of each that then failed)."""
    admits, failures = 0, []
    for budget in budgets:
        engine = admitted(model, budget, kw)
        if engine is None:
            continue
        admits += 1
        try:
            engine.generate(PROMPT, **kw)
        except MemoryBudgetError as e:
            failures.append((budget, str(e)))
    return admits, failures


def test_sampled_llada2_near_the_budget_is_admitted_only_when_it_runs():
    """Budgets above the weights and workspace across the edge of admission (about 469 KB for
    this request): before the fix, 4 of the 5 admitted failed at their first one-block step."""
    model = random_model("llada2", **LLADA2)
    kw = dict(max_new_tokens=64, block_length=32, steps=2) | SAMPLED
    base = model.weight_bytes() + FIXED_BYTES
    admits, failures = runs_what_it_admits(model, kw, [base + x for x in (400_000, 468_992, 520_000, 600_000,
                                                                          700_000, 800_000)])
    assert admits >= 4 and failures == []


FAMILIES = [
    ("llada", {}, dict(max_new_tokens=16, steps=4)),
    ("llada", {}, dict(max_new_tokens=16, steps=4, block_length=4)),
    ("dream", {}, dict(max_new_tokens=16, steps=4)),
    ("llada_moe", {}, dict(max_new_tokens=16, steps=4)),
    ("illada", {}, dict(max_new_tokens=16, steps=4)),
    ("llada2", LLADA2, dict(max_new_tokens=64, block_length=32, steps=2)),
    ("llada2", LLADA2, dict(max_new_tokens=64, block_length=32, steps=2, top_p=0.9)),
    ("llada2", dict(LLADA2, vocab=8192, mask_id=8191, eos_id=8189, pad_id=8189),
     dict(max_new_tokens=64, block_length=32, steps=2, top_k=5)),
]


@pytest.mark.slow
@pytest.mark.parametrize("family, changes, kw", FAMILIES, ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_every_family_near_the_budget_runs_what_it_admits(family, changes, kw, sampling):
    model = random_model(family, **changes)
    offsets = (-1, 0, 64, 256, 1024, 4096, 16384, 65536, 292195)
    assert sweep(model, kw | sampling, offsets) == []
