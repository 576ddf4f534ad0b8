"""Self-speculative decoding gives the step-by-step sampler's tokens (tests/official.py's plain
loops and generate() without speculation), with fewer forwards; every refusal is one clear error.

The method is runtime/samplers/speculative.py; its exactness argument docs/MODELS.md."""

import pytest
import torch
from conftest import bundled, random_model
from official import dream_generate, llada_generate

from mosaic import InputError, MosaicEngine
from mosaic.runtime.samplers import SpeculativeDreamSampler, SpeculativeLLaDASampler, sampler_for
from mosaic.runtime.samplers.base import drive
from mosaic.runtime.samplers.speculative import next_step, same_positions, speculative_loop
from mosaic.runtime.samplers.speculative_families import rank

LLADA_CASES = [
    dict(max_new_tokens=8, steps=8),                              # one token per step, one block
    dict(max_new_tokens=8, steps=8, block_length=4),              # block boundaries
    dict(max_new_tokens=8, steps=16, block_length=4),             # steps that commit nothing
    dict(max_new_tokens=8, steps=4),                              # two tokens per step
    dict(max_new_tokens=8, steps=8, confidence_dtype="float64"),
    dict(max_new_tokens=8, steps=8, logits_eos_inf=True),
]
DREAM_CASES = [
    dict(max_new_tokens=10, steps=10, alg="maskgit_plus"),        # 0, 1, ..., 1, 2 tokens per step
    dict(max_new_tokens=10, steps=10, alg="topk_margin"),
    dict(max_new_tokens=10, steps=10, alg="entropy"),
    dict(max_new_tokens=10, steps=5, alg="entropy"),
    dict(max_new_tokens=10, steps=20, alg="maskgit_plus", top_p=0.9, top_k=7),
]


def ident(case):
    return "-".join(f"{k}={v}" for k, v in case.items())


def engine(fam, **kw):
    return MosaicEngine(random_model(fam), {"progress": False, "sanitize": True, **kw})


def prompts(cfg, lengths, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.mask_id - 4, (n,), generator=g).tolist() for n in lengths]


def padded(cfg, batch):
    """[B, P] left-padded ids (the pad id) and the mask, as a tokenizer writes them."""
    P = max(len(p) for p in batch)
    ids = torch.full((len(batch), P), cfg.pad_id, dtype=torch.long)
    mask = torch.zeros(len(batch), P, dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    return ids, mask


def net(eng):
    return lambda ids, mask: eng.forward_logits(ids, mask)


@pytest.mark.parametrize("case", LLADA_CASES, ids=ident)
@pytest.mark.parametrize("fam", ["llada", "llada_moe"])
@pytest.mark.parametrize("lengths", [(6,), (5, 9, 3)], ids=["batch1", "padded3"])
def test_llada_speculative_equals_the_official_loop(fam, case, lengths):
    eng = engine(fam)
    cfg = eng.model.cfg
    ids, mask = padded(cfg, prompts(cfg, lengths))
    mask = None if len(lengths) == 1 else mask
    G = case["max_new_tokens"]
    ref = llada_generate(net(eng), ids, mask, steps=case["steps"], gen_length=G,
                         block_length=case.get("block_length", G), mask_id=cfg.mask_id,
                         logits_eos_inf=case.get("logits_eos_inf", False), eos_id=cfg.eos_id)
    step_by_step = eng.generate(inputs=ids, attention_mask=mask, **case)
    assert torch.equal(step_by_step.tokens, ref[:, ids.shape[1]:])    # the oracle holds at all
    for k in (2, 4):
        spec = eng.generate(inputs=ids, attention_mask=mask, speculate=k, **case)
        assert torch.equal(spec.tokens, step_by_step.tokens), k
        assert spec.stats["nfe"] <= step_by_step.steps and spec.lossy == []


@pytest.mark.parametrize("case", DREAM_CASES, ids=ident)
@pytest.mark.parametrize("lengths", [(6,), (5, 9, 3)], ids=["batch1", "padded3"])
def test_dream_speculative_equals_the_official_loop(case, lengths):
    eng = engine("dream")
    cfg = eng.model.cfg
    ids, mask = padded(cfg, prompts(cfg, lengths))
    mask = None if len(lengths) == 1 else mask
    greedy = {"temperature": 0.0, "top_p": None, "top_k": None}     # not transformers' defaults
    ref = dream_generate(net(eng), ids, mask, mask_token_id=cfg.mask_id, **{**greedy, **case})
    step_by_step = eng.generate(inputs=ids, attention_mask=mask, **case)
    assert torch.equal(step_by_step.tokens, ref[:, ids.shape[1]:])
    for k in (2, 3, 8):
        spec = eng.generate(inputs=ids, attention_mask=mask, speculate=k, **case)
        assert torch.equal(spec.tokens, step_by_step.tokens), k


@pytest.mark.parametrize("name,kw", [("tiny-llada", {}), ("tiny-dream", {})])
def test_bundled_models_take_fewer_forwards_for_the_same_tokens(name, kw):
    eng = MosaicEngine(bundled(name), {"device": "cpu", "progress": False})
    for prompt in ("sort 31415926=", "57+384=", "sort 907="):
        ref = eng.generate(prompt, **kw)
        spec = eng.generate(prompt, speculate=4, **kw)
        assert torch.equal(spec.tokens, ref.tokens), prompt
        st = spec.stats
        assert st["nfe"] < ref.steps and st["tokens"] == ref.tokens.numel()
        assert sum(n * c for n, c in st["accepted"].items()) <= ref.steps   # steps committed, all rows


def test_every_step_is_streamed_as_the_step_by_step_canvas():
    """on_step sees one call per reference step and, after step s, the reference's canvas (of
    one left-padded request of two rows)."""
    eng = engine("llada")
    ids, mask = padded(eng.model.cfg, prompts(eng.model.cfg, (5, 8)))
    case = dict(max_new_tokens=8, steps=8, block_length=4)
    seen = {}
    for k in (0, 3):
        canvases = []
        eng.generate(inputs=ids, attention_mask=mask, speculate=k,
                     on_step=lambda s, x, c=canvases: c.append((s, x.clone())), **case)
        seen[k] = canvases
    assert [s for s, _ in seen[3]] == list(range(1, 9))
    for (_, a), (_, b) in zip(seen[0], seen[3]):
        assert torch.equal(a, b)


def test_stats_count_forwards_and_acceptance():
    eng = engine("dream")
    out = eng.generate(prompts(eng.model.cfg, (6,))[0], max_new_tokens=10, steps=10, speculate=4)
    st = out.stats
    assert set(st) >= {"speculate", "nfe", "canvases", "tokens", "tokens_per_forward", "accepted", "row_nfe"}
    assert st["speculate"] == 4 and st["tokens"] == 10 and st["row_nfe"] == [st["nfe"]]
    assert st["tokens_per_forward"] == pytest.approx(10 / st["nfe"])
    assert all(1 <= n <= 4 for n in st["accepted"]) and st["canvases"] <= 4 * st["nfe"]
    assert out.steps == 10


@pytest.mark.parametrize("fam,kw,words", [
    ("llada", dict(temperature=0.5), "temperature 0"),
    ("llada", dict(remasking="random"), "low_confidence"),
    ("llada", dict(cfg_scale=1.0), "cfg_scale"),
    ("llada", dict(threshold=0.9), "Fast-dLLM"),
    ("llada", dict(cache="dual", block_length=4), "Fast-dLLM"),
    ("dream", dict(alg="origin"), "origin"),
    ("dream", dict(alg_temp=0.5), "alg_temp"),
    ("dream", dict(temperature=0.3), "temperature 0"),
    ("llada", dict(native=True), "planned path"),
])
def test_refusals_say_what_would_run(fam, kw, words):
    eng = engine(fam)
    with pytest.raises(InputError, match=words):
        eng.generate(prompts(eng.model.cfg, (5,))[0], max_new_tokens=8, steps=8, speculate=3, **kw)


def test_llada2_has_no_speculative_sampler():
    eng = MosaicEngine(random_model("llada2"), {"progress": False})
    with pytest.raises(InputError, match="speculate is a self-speculative sampler option"):
        eng.generate([1, 2, 3], max_new_tokens=8, steps=8, block_length=8, speculate=2)


def test_sampler_choice():
    assert isinstance(sampler_for(random_model("llada").cfg, _gen(speculate=2)), SpeculativeLLaDASampler)
    assert isinstance(sampler_for(random_model("dream").cfg, _gen(speculate=2)), SpeculativeDreamSampler)
    assert not isinstance(sampler_for(random_model("dream").cfg, _gen()), SpeculativeDreamSampler)


def _gen(**kw):
    from mosaic.config import GenerationConfig
    return GenerationConfig(**kw)


# -- the acceptance rule on a toy family (no model): a predict whose decisions are known


class ToyFamily:
    """A family over canvases of L slots: the 'model' predicts token 10 + slot everywhere and the
    slot's index as its confidence; with `drift` the order flips with the parity of the masked
    count, so at one token per step no draft past the first is right (until one slot is left)."""

    class mcfg:  # noqa: N801
        mask_id = 0

    def __init__(self, drift: bool, steps: int):
        self.drift, self.steps, self.forwards = drift, steps, 0

    def schedule(self, x, prompt_len, gen):
        n = x.shape[1] - prompt_len
        return [P_counts(n, self.steps) for _ in range(x.shape[0])]

    def right_of(self, prompt_len, gen, L):
        return lambda i: L

    def confidences(self, canvas):
        L = canvas.shape[0]
        masked = int((canvas == 0).sum())
        base = torch.arange(L, dtype=torch.float32)
        conf = -base if self.drift and masked % 2 else base      # drift: the order flips every commit
        return torch.where(canvas == 0, conf, torch.tensor(-torch.inf))

    def verify(self, ids, rights, owners, gen, generator):
        self.forwards += 1
        x0 = torch.where(ids == 0, 10 + torch.arange(ids.shape[1]), ids)
        return x0, torch.stack([self.confidences(c) for c in ids])
        yield  # noqa: B901 (a generator that never yields a call)

    def decide(self, conf, k, start=0):
        return rank(conf, k, start)


def P_counts(n, steps):  # noqa: N802
    base, extra = divmod(n, steps)
    return [base + (i < extra) for i in range(steps)]


def step_by_step(fam, x, prompt_len):
    counts = fam.schedule(x, prompt_len, None)
    for i in range(len(counts[0])):
        for b in range(x.shape[0]):
            if counts[b][i]:
                pos = rank(fam.confidences(x[b]), counts[b][i])
                x[b, pos] = 10 + pos
    return x


@pytest.mark.parametrize("drift", [False, True])
@pytest.mark.parametrize("steps", [12, 6, 24])
def test_toy_acceptance(drift, steps):
    class gen:  # noqa: N801
        speculate = 4
    x = torch.ones(2, 16, dtype=torch.long)
    x[:, 4:] = 0
    ref = step_by_step(ToyFamily(drift, steps), x.clone(), 4)
    fam = ToyFamily(drift, steps)
    got = x.clone()
    masked = []
    stats = drive(speculative_loop(fam, got, 4, gen, None), on_step=masked.append)
    assert torch.equal(got, ref)
    assert len(masked) == steps and masked[0] == 2 * 12       # one StepDone per reference step
    if drift and steps == 12:    # every draft past the first is wrong, but the last one
        assert set(stats["accepted"]) == {1, 2} and stats["accepted"][2] == 2
    elif not drift and steps == 12:  # the ranking never changes: every draft is right
        assert stats["accepted"] == {4: 6} and stats["nfe"] == 4   # 1 + 3 forwards, the last canvas needs none
    assert stats["nfe"] == fam.forwards


def test_helpers():
    assert next_step([0, 0, 1, 0, 2], 0) == 2 and next_step([0, 0, 1, 0, 2], 3) == 4
    assert next_step([1, 0], 1) == 2
    p, t = torch.tensor([3, 1]), torch.tensor([7, 5])
    assert same_positions(p, t, torch.tensor([1, 3]), torch.tensor([5, 7]))
    assert not same_positions(p, t, torch.tensor([1, 3]), torch.tensor([7, 5]))
    assert not same_positions(p, t, torch.tensor([1]), torch.tensor([5]))


def test_rank_is_the_published_topk_on_ties():
    """A row's ranking is torch.topk on its own full-length vector: the same choice among ties as
    the published calls (LLaDA: per row; Dream: one call over the [B, L] batch)."""
    g = torch.Generator().manual_seed(0)
    conf = torch.randint(0, 3, (6, 40), generator=g).float()           # many ties
    conf[conf == 0] = -torch.inf
    for k in (1, 2, 5):
        batched = torch.topk(conf, k).indices
        for b in range(conf.shape[0]):
            assert torch.equal(rank(conf[b], k), batched[b])
            assert torch.equal(rank(conf[b].clone(), k), torch.topk(conf[b], k).indices)


def test_the_cuda_label_names_what_makes_it_exact():
    """On CUDA without batch_invariant the verification's GEMMs may round otherwise than a
    one-canvas step: labelled; with batch_invariant, or on the CPU, no label."""
    from mosaic.config import EngineConfig
    from mosaic.policy.features import Setting, lossy_labels
    model = random_model("llada")
    sampler = sampler_for(model.cfg, _gen(speculate=2))
    for config, dev, labelled in ((EngineConfig(), "cuda", True), (EngineConfig(batch_invariant=True), "cuda", False),
                                  (EngineConfig(), "cpu", False)):
        s = Setting(config, _gen(speculate=2), "llada", device_type=dev)
        got = lossy_labels(s, None, sampler)
        assert any("batch_invariant" in t for t in got) == labelled, (dev, config.batch_invariant)


@pytest.mark.parametrize("fam", ["llada", "dream"])
def test_more_drafts_than_steps_cost_only_what_a_chain_can_use(fam):
    eng = engine(fam)
    prompt = prompts(eng.model.cfg, (5,))[0]
    blocks = dict(block_length=4) if fam == "llada" else {}
    want = eng.generate(prompt, max_new_tokens=8, steps=8, **blocks).tokens
    huge = eng.generate(prompt, max_new_tokens=8, steps=8, speculate=100000, **blocks)
    assert torch.equal(huge.tokens, want)
    gen = eng.generation_config(max_new_tokens=8, steps=8, speculate=100000, **blocks)
    sampler = eng.requests.build(prompt, config=gen).sampler
    assert sampler.canvases(gen) == (4 if fam == "llada" else 8)     # LLaDA: a chain stays in its block
