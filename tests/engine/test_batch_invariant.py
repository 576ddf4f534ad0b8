"""EngineConfig(batch_invariant=True) on the CPU: a sequence's planned-step outputs are the same
bits alone and among other sequences, speculation gives the step-by-step tokens there too, and
what it cannot do yet is refused. (The GPU side: tests/gpu/test_batch_invariant_gpu.py.)"""

import pytest
import torch
from conftest import random_model

from mosaic import InputError, MosaicEngine
from mosaic.cli_args import build_parser
from mosaic.cli_options import engine_config_from_args
from mosaic.config import GenerationConfig
from mosaic.engine.steps import RowsState
from mosaic.runtime.reducers import DreamReducer, LLaDAReducer
from mosaic.runtime.samplers.base import RowsCall


def step_outputs(eng, ids):
    """(x0, conf) of one planned step over every masked slot of canvases ids [B, L]."""
    cfg = eng.model.cfg
    B, L = ids.shape
    pos = (ids == cfg.mask_id).reshape(-1).nonzero().squeeze(1)
    gen = GenerationConfig(max_new_tokens=L // 2)
    if cfg.family == "dream":
        rows = torch.where(pos % L == 0, pos, pos - 1)
        call = RowsCall(ids, rows, None, DreamReducer(gen, None, True), positions=pos)
    else:
        call = RowsCall(ids, pos, None, LLaDAReducer(cfg, gen, pos, B * L, None, ids.device))
    outs = eng.executor(call, RowsState())
    return outs["x0"].view(B, -1), outs["conf"].view(B, -1)


def canvases(cfg, B, L, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.mask_id - 4, (B, L), generator=g)
    ids[:, L // 2:] = cfg.mask_id
    ids[:, L // 2 + 1::3] = torch.randint(0, cfg.mask_id - 4, (1,), generator=g)   # some decoded
    return ids


def test_a_sequences_step_is_the_same_bits_alone_and_in_a_batch(family):
    eng = MosaicEngine(random_model(family), {"progress": False, "batch_invariant": True})
    batch = canvases(eng.model.cfg, 5, 24)
    x0, conf = step_outputs(eng, batch)
    for b in range(batch.shape[0]):
        x0_1, conf_1 = step_outputs(eng, batch[b:b + 1])
        assert torch.equal(x0_1[0], x0[b]) and torch.equal(conf_1[0], conf[b]), b
        # and in another company: the same canvas with two others
        other = torch.cat([canvases(eng.model.cfg, 2, 24, seed=9), batch[b:b + 1]])
        x0_3, conf_3 = step_outputs(eng, other)
        assert torch.equal(conf_3[2], conf[b])


@pytest.mark.parametrize("fam,case", [
    ("llada", dict(max_new_tokens=8, steps=8, block_length=4)),
    ("llada_moe", dict(max_new_tokens=8, steps=8)),
    ("dream", dict(max_new_tokens=8, steps=8, alg="entropy")),
])
def test_speculation_in_batch_invariant_mode_gives_the_step_by_step_tokens(fam, case):
    model = random_model(fam)
    inv = MosaicEngine(model, {"progress": False, "batch_invariant": True})
    default = MosaicEngine(model, {"progress": False})
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(0, model.cfg.mask_id - 4, (n,), generator=g).tolist() for n in (6, 9)]
    ref = inv.generate(batch, **case)
    spec = inv.generate(batch, speculate=3, **case)
    assert torch.equal(spec.tokens, ref.tokens)
    assert torch.equal(ref.tokens, default.generate(batch, **case).tokens)   # same tokens, other rounding


@pytest.mark.parametrize("config,words", [
    ({"native": True}, "planned path"),
    ({"sparse": {"ranges": [{"layers": [0, 1], "pattern": "topk", "keep": 0.5}]}}, "block-sparse"),
])
def test_what_batch_invariant_mode_refuses(config, words):
    # refused when the engine is built (a server would otherwise start and refuse every request)
    with pytest.raises(InputError, match=words):
        MosaicEngine(random_model("llada"), {"progress": False, "batch_invariant": True, **config})
    with pytest.raises(InputError, match=words):                 # a preset: before its weights load
        MosaicEngine("tiny-llada", {"progress": False, "batch_invariant": True, **config})


def test_the_flag_and_the_config_value():
    args = build_parser().parse_args(["generate", "--batch-invariant"])
    assert engine_config_from_args(args).batch_invariant is True
    assert engine_config_from_args(build_parser().parse_args(["generate"])).batch_invariant is False
    with pytest.raises(InputError, match="batch_invariant"):
        MosaicEngine(random_model("llada"), {"batch_invariant": "yes"})


@pytest.mark.parametrize("family", ["llada", "dream", "llada_moe"])
@pytest.mark.parametrize("inv", [False, True], ids=["default", "invariant"])
def test_speculative_requests_in_a_continuous_batch_keep_their_tokens(family, inv):
    """Requests of mixed lengths and options, some speculative, stacked by the Scheduler's round
    executor (engine/batching.py): every one gets its step-by-step tokens alone."""
    from mosaic.engine.scheduler import Scheduler
    eng = MosaicEngine(random_model(family), {"progress": False, "batch_invariant": inv})
    base = dict(max_new_tokens=8, steps=8)
    cases = [([3, 4, 5, 6], dict(base, speculate=3)), ([7, 8, 9, 10, 11, 12, 13], dict(base)),
             ([5, 6], dict(base, speculate=2)), ([9, 10, 11], dict(base, speculate=4))]
    ref = [eng.generate(p, **{k: v for k, v in o.items() if k != "speculate"}).tokens for p, o in cases]
    sched = Scheduler(eng)
    runs = [eng.start(eng.request(p, **o)) for p, o in cases]
    for run in runs:
        sched.add(run)
    assert all(f.error is None for f in sched.run_all())
    for run, want in zip(runs, ref):
        assert torch.equal(run.result().tokens, want)
    assert not sched.stats.fallbacks, sched.stats.fallbacks
    assert sched.stats.stacked_steps > 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_tokens_do_not_depend_on_the_batch_mates(seed):
    """batch_invariant at temperature > 0: a prompt's tokens are the ones it gets alone, whoever
    it is batched with (each request's random stream is its own, keyed by the request: its seed),
    here on the bundled model at temperature 5 where every draw matters."""
    eng = MosaicEngine("tiny-llada", {"device": "cpu", "progress": False, "batch_invariant": True})
    opts = dict(max_new_tokens=8, steps=8, temperature=5.0, seed=seed)
    alone = eng.generate("sort 31415926=", **opts).tokens[0]
    for mates in (["sort 9="], ["sort 9=", "57+384="]):
        together = eng.generate(["sort 31415926=", *mates], **opts)
        assert torch.equal(together.tokens[0], alone), (seed, mates)
        assert torch.equal(together.tokens[1], eng.generate(mates[0], **opts).tokens[0])
