"""Fast-dLLM decoding: Mosaic's tokens equal plain re-implementations of the published functions
(tests/plain_fast.py) for every cache mode and commit rule; refusals; the K/V store's tiers."""

import json

import pytest
import torch
from conftest import bundled, left_padded, needs_cuda, random_model
from plain_fast import PlainLM, Spin, dream_block_generate, dream_threshold_generate, llada_generate

from mosaic import MosaicEngine, load
from mosaic.assets import tasks
from mosaic.cli import main as cli_main
from mosaic.config import GenerationConfig
from mosaic.errors import InputError, MemoryBudgetError
from mosaic.runtime.samplers import FastLLaDASampler, sampler_for
from mosaic.runtime.samplers.fast_common import select_factor, select_threshold

RULES = [dict(threshold=0.2), dict(factor=1.0), dict()]


def engine(model, **cfg):
    return MosaicEngine(model, {"sanitize": True, "progress": False, **cfg})


def prompt_of(cfg, n=6, batch=1, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.mask_id - 4, (batch, n), generator=g)


def ids(case):
    return "-".join(f"{k}={v}" for k, v in case.items())


LLADA_CASES = [dict(cache=c, block_length=bl, temperature=t, seed=s, remasking=r, **rule)
               for c in ("none", "prefix", "dual") for rule in RULES if c != "none" or rule
               for bl in (4, 8) for t, s, r in ((0.0, 0, "low_confidence"), (0.7, 3, "low_confidence"),
                                                (0.0, 5, "random"))] + \
    [dict(cache=c, block_length=4, steps=2, **rule) for c in ("none", "prefix", "dual")  # one step per block
     for rule in RULES[:2]]


@pytest.mark.parametrize("case", LLADA_CASES, ids=ids)
def test_llada_equals_published(case):
    model = random_model("llada")
    p = prompt_of(model.cfg)
    rule = {k: case[k] for k in ("threshold", "factor") if k in case}
    case = {"steps": 8, "temperature": 0.0, "seed": 0, "remasking": "low_confidence", **case}
    ref, nfe = llada_generate(PlainLM(model), p, case["steps"], 8, case["block_length"], case["temperature"],
                              case["remasking"], cache=case["cache"], g=torch.Generator().manual_seed(case["seed"]),
                              **rule)
    out = engine(model).generate(p[0].tolist(), max_new_tokens=8, **case)
    assert torch.equal(out.tokens, ref[:, p.shape[1]:])
    assert out.stats["nfe"] == out.steps == nfe


@pytest.mark.parametrize("cache, rule", [("none", dict(threshold=0.2)), ("prefix", dict(threshold=0.2)),
                                         ("dual", dict(threshold=0.2)), ("prefix", dict()), ("dual", dict())],
                         ids=lambda v: v if isinstance(v, str) else ids(v) or "counts")
def test_llada_batch_equals_published(cache, rule):
    """The published LLaDA functions take a batch of equal-length prompts."""
    model = random_model("llada")
    p = prompt_of(model.cfg, batch=2)
    ref, nfe = llada_generate(PlainLM(model), p, 8, 8, 4, cache=cache, **rule)
    out = engine(model).generate(p, max_new_tokens=8, steps=8, block_length=4, cache=cache, **rule)   # one request
    assert torch.equal(out.tokens, ref[:, p.shape[1]:]) and out.stats["nfe"] == nfe
    alone = [llada_generate(PlainLM(model), p[j:j + 1], 8, 8, 4, cache=cache, **rule)[1] for j in range(2)]
    assert out.stats["nfe_per_row"] == alone


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_llada_padded_batch(cache):
    """Left padding (Mosaic's extension): pads masked as keys, positions counting them, as LLaDA's
    reference does; the published functions with that key mask give the same tokens."""
    model = random_model("llada")
    cfg = model.cfg
    short, long_ = prompt_of(cfg, 4, seed=1)[0].tolist(), prompt_of(cfg, 7, seed=2)[0].tolist()
    p = torch.tensor([[cfg.pad_id] * 3 + short, long_])
    valid = torch.ones(2, 7 + 8, dtype=torch.bool)
    valid[0, :3] = False
    ref, nfe = llada_generate(PlainLM(model), p, 8, 8, 4, threshold=0.2, cache=cache, valid=valid)
    ids, mask = left_padded(cfg, [short, long_])
    out = engine(model).generate(inputs=ids, attention_mask=mask, max_new_tokens=8, steps=8, block_length=4,
                                 cache=cache, threshold=0.2)
    assert torch.equal(out.tokens, ref[:, 7:]) and out.stats["nfe"] == nfe


DREAM_CASES = [dict(cache=c, block_length=bl, temperature=t, seed=s, **extra, **rule)
               for c in ("prefix", "dual") for rule in (dict(threshold=0.2), dict(alg="entropy"))
               for bl in (4, 8) for t, s, extra in ((0.0, 0, {}), (0.7, 3, {}), (0.6, 4, dict(top_p=0.9)))]


def _nfe_matches(out, nfe, mask_id):
    """The published cached Dream schedule spends one forward it discards when a committed mask
    id left the block incomplete; Mosaic does not run it."""
    if bool((out.tokens == mask_id).any()):
        return out.stats["nfe"] <= nfe
    return out.stats["nfe"] == nfe


@pytest.mark.parametrize("case", DREAM_CASES, ids=ids)
def test_dream_block_cache_equals_published(case):
    model = random_model("dream")
    p = prompt_of(model.cfg)
    ref, nfe = dream_block_generate(PlainLM(model), p, 8, 8, case["block_length"], threshold=case.get("threshold"),
                                    dual=case["cache"] == "dual", temperature=case["temperature"],
                                    top_p=case.get("top_p"), g=torch.Generator().manual_seed(case["seed"]))
    out = engine(model).generate(p[0].tolist(), max_new_tokens=8, steps=8, **case)
    assert torch.equal(out.tokens, ref[:, p.shape[1]:])
    assert _nfe_matches(out, nfe, model.cfg.mask_id)


@pytest.mark.parametrize("steps", [8, 4, 2])
@pytest.mark.parametrize("threshold", [0.2, 0.05])
@pytest.mark.parametrize("temperature, seed", [(0.0, 0), (0.7, 3)])
def test_dream_uncached_threshold_equals_published(steps, threshold, temperature, seed):
    model = random_model("dream")
    p = prompt_of(model.cfg)
    ref, nfe = dream_threshold_generate(PlainLM(model), p, 8, steps, threshold, temperature,
                                        g=torch.Generator().manual_seed(seed))
    out = engine(model).generate(p[0].tolist(), max_new_tokens=8, steps=steps, threshold=threshold,
                                 temperature=temperature, seed=seed)
    assert torch.equal(out.tokens, ref[:, p.shape[1]:]) and out.stats["nfe"] == nfe


@pytest.mark.parametrize("case", [dict(cache="dual", threshold=0.2, block_length=4),
                                  dict(cache="prefix", alg="entropy", block_length=4),
                                  dict(threshold=0.2)], ids=ids)
def test_dream_padded_batch_rows_equal_alone(case):
    """Batches (Mosaic's extension: the published threshold loops decide row 0 only): each row of
    a left-padded greedy batch gets the tokens it gets alone."""
    model = random_model("dream")
    e = engine(model)
    a, b = prompt_of(model.cfg, 4, seed=1)[0].tolist(), prompt_of(model.cfg, 7, seed=2)[0].tolist()
    ids, mask = left_padded(model.cfg, [a, b])
    both = e.generate(inputs=ids, attention_mask=mask, max_new_tokens=8, steps=8, **case)
    alone = [e.generate(q, max_new_tokens=8, steps=8, **case) for q in (a, b)]
    assert torch.equal(both.tokens, torch.cat([r.tokens for r in alone]))
    assert both.stats["nfe_per_row"] == [r.stats["nfe"] for r in alone]


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_bundled_llada_equals_published_and_answers(cache):
    model = load(bundled("tiny-llada"))
    e = engine(model)
    tok = model.tokenizer
    batch = ["sort 31415926=", "sort 90210733="]
    p = torch.tensor([tok.encode(q) for q in batch])
    ref, nfe = llada_generate(PlainLM(model), p, 8, 8, 4, threshold=0.9, cache=cache)
    out = e.generate(p, max_new_tokens=8, steps=8, block_length=4, threshold=0.9, cache=cache)
    assert e.generate(batch, max_new_tokens=8, steps=8, block_length=4, threshold=0.9, cache=cache).texts == out.texts
    assert torch.equal(out.tokens, ref[:, p.shape[1]:]) and out.stats["nfe"] == nfe
    assert out.texts == [tasks.solve(q) for q in batch]
    assert nfe < 8   # parallel commits: fewer forwards than tokens


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_bundled_dream_equals_published(cache):
    model = load(bundled("tiny-dream"))
    p = torch.tensor([model.tokenizer.encode("sort 52830=")])
    ref, nfe = dream_block_generate(PlainLM(model), p, 8, 8, 4, threshold=0.9, dual=cache == "dual")
    out = engine(model).generate("sort 52830=", max_new_tokens=8, steps=8, block_length=4, threshold=0.9,
                                 cache=cache)
    assert torch.equal(out.tokens, ref[:, p.shape[1]:]) and out.stats["nfe"] == nfe


@pytest.mark.parametrize("fam", ["llada", "llada_moe"])
def test_threshold_one_is_the_reference_schedule(fam):
    """threshold 1.0 commits only the most confident candidate per step: the reference sampler
    with one token per step (float64 confidence, as Fast-dLLM takes it); LLaDA-MoE included.
    With a cache, the fill and block steps of LLaDA-MoE run too."""
    model = random_model(fam)
    e = engine(model)
    p = prompt_of(model.cfg)[0].tolist()
    exact = e.generate(p, max_new_tokens=8, steps=8, block_length=4, confidence_dtype="float64")
    fast = e.generate(p, max_new_tokens=8, steps=8, block_length=4, threshold=1.0)
    assert torch.equal(exact.tokens, fast.tokens) and fast.stats["nfe"] == 8
    for cache in ("prefix", "dual"):
        out = e.generate(p, max_new_tokens=8, steps=8, block_length=4, threshold=1.0, cache=cache)
        assert out.stats["nfe"] == 8   # one commit per step: the fill and 3 block steps per block


REFUSED = [
    ("llada", dict(cache="dual", block_length=3), "not divisible by block_length 3"),
    ("llada", dict(cache="prefix", block_length=4, steps=3), "multiple of the number of blocks"),
    ("llada", dict(threshold=0.9, cfg_scale=1.0), "cfg_scale cannot be combined"),
    ("llada", dict(cache="dual", logits_eos_inf=True), "logits_eos_inf cannot be combined"),
    ("dream", dict(cache="dual", block_length=3), "not divisible by block_length 3"),
    ("dream", dict(cache="dual", block_length=4, steps=3), "multiple of the number of blocks"),
    ("dream", dict(cache="dual", block_length=4, steps=2, alg="entropy"), "steps per block must be >= 2"),
    ("dream", dict(factor=1.0), "factor with Dream needs cache"),
    ("dream", dict(threshold=0.9, steps=3), "multiple of steps 3"),
    ("dream", dict(threshold=0.9, block_length=4), "block_length with Dream applies to cache"),
    ("dream", dict(cache="prefix", threshold=0.9, alg="entropy"), "alg 'maskgit_plus'"),
    ("dream", dict(cache="prefix", alg="origin"), "alg 'origin' has no confidence"),
]


@pytest.mark.parametrize("fam, kw, msg", REFUSED, ids=[r[2] for r in REFUSED])
def test_refused_combinations(fam, kw, msg):
    e = engine(random_model(fam))
    with pytest.raises(InputError, match=msg):
        e.generate([1, 2, 3], max_new_tokens=8, **{"steps": 8, **kw})


@pytest.mark.parametrize("kw, msg", [(dict(cache="full"), "cache='full' is not one of"),
                                     (dict(threshold=0.0), "must be in \\(0, 1\\]"),
                                     (dict(threshold=1.2), "must be in \\(0, 1\\]"),
                                     (dict(factor=-1.0), "must be positive"),
                                     (dict(threshold=0.9, factor=1.0), "set one of them")])
def test_config_validation(kw, msg):
    with pytest.raises(InputError, match=msg):
        GenerationConfig(**kw)


def test_native_path_refused_and_default_untouched():
    model = random_model("llada")
    e = engine(model)
    with pytest.raises(InputError, match="planned path only"):
        e.generate([1, 2, 3], max_new_tokens=8, native=True, cache="dual")
    out = e.generate([1, 2, 3], max_new_tokens=8, steps=8)
    assert out.lossy == [] and out.stats == {} and out.steps == 8
    assert type(sampler_for(model.cfg, GenerationConfig())).__name__ == "LLaDASampler"


def test_commit_rules_by_hand():
    conf = torch.tensor([[0.95, -torch.inf, 0.5, 0.91, 0.2], [-torch.inf] * 5])
    assert select_threshold(conf, 0.9).tolist()[0] == [True, False, False, True, False]
    assert not select_threshold(conf, 0.9)[1].any()                 # no candidate: nothing
    assert select_threshold(torch.tensor([[0.3, 0.1]]), 0.9).tolist() == [[True, False]]   # at least one
    # factor 1: ranks need -1, 1 - 1/3, 1 - 1/4, ...: 0.95 >= 0.667, 0.91 >= 0.75, 0.5 < 0.8 -> 2
    assert select_factor(conf, 1.0).tolist()[0] == [True, False, False, True, False]
    # a failure at the last rank commits every candidate (the published rule's quirk)
    assert select_factor(torch.tensor([[0.9, 0.1]]), 1.0).tolist() == [[True, True]]


def test_committed_mask_id_terminates():
    """A model that always predicts the mask id: the published loops would spin forever (or
    raise); Mosaic ends each block after block_length steps."""
    model = random_model("llada")
    sampler = FastLLaDASampler(model.cfg)
    gen = GenerationConfig(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.9)
    x = torch.full((1, 11), model.cfg.mask_id)
    x[0, :3] = torch.tensor([1, 2, 3])

    def predict(x, a, b, cand, mode, extra_noise=False):
        return torch.full((1, b - a), model.cfg.mask_id), torch.where(cand, 1.0, -torch.inf).double()
    calls = []
    sampler.run(predict, x, 3, gen, None, on_step=calls.append)
    assert len(calls) == 2 * 4   # blocks x block_length

    class MaskLM:                # the same model for the published loop: the mask id always wins
        cfg, calls = model.cfg, 0

        def __call__(self, ids, past=None, replace=None, valid=None):
            self.calls += 1
            if self.calls > 100:
                raise Spin("the published loop would spin")
            logits = torch.zeros(*ids.shape, model.cfg.vocab)
            logits[..., model.cfg.mask_id] = 10.0
            return logits, [(torch.zeros(1, 1, ids.shape[1], 1),) * 2]
    with pytest.raises(Spin):
        llada_generate(MaskLM(), x[:, :3], 8, 8, 4, threshold=0.9, cache="none")


def test_host_tier_equals_device_tier():
    model = random_model("llada", num_layers=5)
    p = prompt_of(model.cfg)[0].tolist()
    kw = dict(max_new_tokens=8, steps=8, block_length=4, threshold=0.2)
    for cache in ("prefix", "dual"):
        dev = engine(model, kv_tier="device").generate(p, cache=cache, **kw)
        host = engine(model, kv_tier="host").generate(p, cache=cache, **kw)
        assert torch.equal(dev.tokens, host.tokens)
        assert host.stats["kv_tier"] == "host" and host.stats["kv_transfer_bytes"] > 0
        assert dev.stats["kv_transfer_bytes"] == 0


def test_admission_charges_the_store_and_auto_tier_splits():
    model = random_model("llada", num_layers=8)
    gen = dict(max_new_tokens=8, steps=8, block_length=4, cache="dual", threshold=0.2)
    p = prompt_of(model.cfg)[0].tolist()
    free = engine(model, kv_tier="device")
    first = free.generate(p, **gen)
    need = first.predicted_bytes
    layer = first.stats["kv_device_bytes"] // model.cfg.num_layers    # every layer hot: no slots
    budget = need - 3 * layer     # the plan fits, all 8 layers of K/V do not
    with pytest.raises(MemoryBudgetError, match="block cache"):
        engine(model, kv_tier="device", memory_budget=budget).generate(p, **gen)
    auto = engine(model, kv_tier="auto", memory_budget=budget)
    out = auto.generate(p, **gen)
    # some layers hot, the rest on the host through 2 slots (chunking may free room for one more)
    assert out.stats["kv_tier"] == "split" and 3 <= out.stats["hot_layers"] < 8 - 2
    assert out.predicted_bytes <= budget
    assert torch.equal(out.tokens, free.generate(p, **gen).tokens)


def test_cli_json_carries_labels_and_nfe(capsys):
    rc = cli_main(["generate", "--cache", "dual", "--threshold", "0.9", "--block-length", "4", "--json",
                   "--device", "cpu"])
    assert rc == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["lossy"][0].startswith("fast-dllm: cache=dual") and rec["fast"]["nfe"] == rec["steps"] < 8
    assert cli_main(["generate", "--cache", "dual", "--block-length", "3", "--device", "cpu"]) == 2
    assert "not divisible by --block-length" in capsys.readouterr().err


def test_plan_reports_lmax_with_the_cache(capsys):
    assert cli_main(["plan", "--model", "llada-8b", "--budget", "40GiB", "--json", "--device", "cuda"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli_main(["plan", "--model", "llada-8b", "--budget", "40GiB", "--kv-tier", "device", "--json",
                     "--device", "cuda"]) == 0
    dev = json.loads(capsys.readouterr().out)
    assert cli_main(["plan", "--model", "llada-8b", "--budget", "40GiB", "--kv-tier", "host", "--json",
                     "--device", "cuda"]) == 0
    host = json.loads(capsys.readouterr().out)
    # every layer's K/V per token (512 KiB for LLaDA-8B) on the device: far shorter; host: in between
    assert dev["kv_cache_bytes_per_token"] == 32 * 2 * 4096 * 2
    assert dev["l_max"] < host["l_max"] < plain["l_max"]


@needs_cuda
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cuda_tiers_keep_tokens(cache):
    """On a GPU: the host tier's side-stream prefetch and write-back give the device tier's tokens,
    and the split an 'auto' budget picks does too."""
    model = load(bundled("tiny-llada"), device="cuda")
    kw = dict(max_new_tokens=8, steps=2, block_length=4, threshold=0.9, cache=cache)
    batch = ["sort 31415926=", "sort 90210733="]
    dev = engine(model, kv_tier="device").generate(batch, **kw)
    host = engine(model, kv_tier="host").generate(batch, **kw)
    assert torch.equal(dev.tokens, host.tokens) and host.stats["kv_transfer_bytes"] > 0
    assert dev.texts == [tasks.solve(q) for q in batch]


def test_host_tier_refused_beyond_host_memory():
    from mosaic.memory.kv_store import StoreLayout
    from mosaic.policy.kv_tier import check_host
    layout = StoreLayout(32, 1, 65536, 4096, 2, hot=0)      # LLaDA-8B at 64k: 32 x 1 GiB on the host
    assert layout.host_bytes == 32 * 2**30 and layout.device_bytes == 2 * 2**30
    with pytest.raises(MemoryBudgetError, match="pinned host memory"):
        check_host(layout, available=16 * 2**30)
    check_host(layout, available=64 * 2**30)
