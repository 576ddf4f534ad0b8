"""LLaDA2.x's published sampler beyond LLaDA2.0's greedy path, through the engine on tiny random
checkpoints (CPU, float32), token for token against plain re-implementations of the published
generate(): LLaDA2.0 seeded sampling (the published random stream: one torch.multinomial over
every row of the block), LLaDA2.1's token editing (llada21_generate below: the LLaDA2.1-mini
copy of modeling_llada2_moe.py), its choice from the checkpoint's own generate() defaults, the
per-request eos_id and eos_early_stop."""

import json

import pytest
import torch
from plain_families import TINY_LLADA2, llada2_forward, llada2_generate, llada2_keys, random_state, sample
from safetensors.torch import save_file

from mosaic import MosaicEngine, load
from mosaic.errors import InputError

EOS, MASK = 45, 47


@torch.no_grad()
def llada21_generate(forward, prompt, temperature=0.0, block_length=32, gen_length=2048, top_p=None, top_k=None,  # noqa: C901
                     eos_early_stop=False, threshold=0.95, editing_threshold=0.9, max_post_steps=16, eos_id=EOS,
                     mask_id=MASK, num_to_transfer=1, generator=None):
    """LLaDA2.1's generate() for one prompt [1, P] (inclusionAI/LLaDA2.1-mini): fill at least
    num_to_transfer masked positions per step (every one above threshold when that is as many),
    rewrite filled non-prompt positions whose new prediction differs above editing_threshold,
    and keep editing up to max_post_steps steps after the block is filled. Returns the answer
    up to and including its first eos_id. One departure, Mosaic's (docs/MODELS.md): a step at
    temperature 0 that changes no token ends the block (the published loop would repeat it
    forever: tiny random models predict the mask token itself), and a block ends after
    8 x block_length + max_post_steps steps."""
    P = prompt.shape[1]
    nb = (P + gen_length + block_length - 1) // block_length
    m = torch.tril(torch.ones(nb, nb)).repeat_interleave(block_length, 0).repeat_interleave(block_length, 1)
    mask4 = torch.where(m.bool(), 0.0, float("-inf"))[None, None]
    pos = torch.arange(nb * block_length)[None]
    x = torch.full((1, nb * block_length), mask_id, dtype=torch.long)
    x[:, :P] = prompt
    for b in range(P // block_length, nb):
        end = (b + 1) * block_length
        cur = x[:, :end]
        in_prompt = torch.arange(b * block_length, end) < P
        post = 0
        for _ in range(8 * block_length + max_post_steps):
            old = cur[:, -block_length:].clone()
            active = cur[:, -block_length:] == mask_id
            if not torch.any(active):
                post += 1
            if post > max_post_steps:
                break
            logits = forward(cur, mask4[:, :, :end, :end], pos[:, :end])
            x0, x0_p = sample(logits[:, -block_length:], temperature, top_k, top_p, generator)
            fill = torch.zeros_like(x0, dtype=torch.bool)
            if active.sum() > 0:
                conf = torch.where(active, x0_p, -torch.inf)
                high = (conf[0] > threshold) & active[0]
                if int(high.sum()) >= num_to_transfer:
                    fill[0] = high
                else:
                    fill[0, torch.topk(conf[0], k=min(num_to_transfer, int(active.sum())))[1]] = True
            editable = ~active & ~in_prompt[None]
            edit = torch.zeros_like(x0, dtype=torch.bool)
            edit[0] = (torch.where(editable, x0_p, -torch.inf)[0] > editing_threshold) & editable[0] & (x0[0] != old[0])
            take = fill | edit
            if take.any():
                cur[:, -block_length:][take] = x0[take]
            if active.sum() == 0 and not edit.any():
                break
            if temperature == 0 and not (take & (x0 != old)).any():
                break
        x[:, :end] = cur
        if eos_early_stop and (x[0, P:end] == mask_id).sum() == 0 and (x[0, P:end] == eos_id).any():
            break
    ans = x[0, P:P + gen_length]
    hits = (ans == eos_id).nonzero()
    return ans[:int(hits[0]) + 1 if len(hits) else gen_length].tolist()


def checkpoint(folder, code: str | None = None, generation: dict | None = None):
    sd = random_state(llada2_keys(TINY_LLADA2), 1)
    save_file(sd, str(folder / "model.safetensors"))
    raw = dict(TINY_LLADA2)
    if code is not None:     # the checkpoint's own modeling file (its generate() defaults are read, not run)
        raw["auto_map"] = {"AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"}
        (folder / "modeling_llada2_moe.py").write_text(code)
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    (folder / "config.json").write_text(json.dumps(raw))
    return folder, sd


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("llada2"))


def forward_of(sd):
    return lambda ids, m, pos: llada2_forward(sd, TINY_LLADA2, ids, m, pos)


def prompt_of(n, seed):
    return torch.randint(0, 44, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def answer(tokens):
    t = tokens.tolist()
    return t[: t.index(EOS) + 1] if EOS in t else t


SAMPLED = [dict(gen_length=12, block_length=4, steps=4, temperature=0.8, seed=1),
           dict(gen_length=10, block_length=4, steps=2, temperature=1.0, top_k=5, threshold=0.3, seed=2),
           dict(gen_length=9, block_length=3, steps=3, temperature=0.7, top_p=0.8, seed=3)]


@pytest.mark.parametrize("case", SAMPLED, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_llada20_seeded_sampling_is_the_published_stream(ckpt, case):
    """The published code draws one multinomial over every row of the block; Mosaic draws the
    same noise and keeps its masked rows: the same tokens for the same seed."""
    folder, sd = ckpt
    engine = MosaicEngine(load(folder, device="cpu", dtype="float32"), {"progress": False})
    case = dict(case)
    seed = case.pop("seed")
    for n in (5, 9):
        p = prompt_of(n, seed + n)
        got = engine.generate([p], max_new_tokens=case["gen_length"], seed=seed,
                              **{k: v for k, v in case.items() if k != "gen_length"})
        ref = llada2_generate(forward_of(sd), torch.tensor([p]), eos_id=EOS, mask_id=MASK,
                              generator=torch.Generator().manual_seed(seed), threshold=case.get("threshold", 0.95),
                              **{k: v for k, v in case.items() if k != "threshold"})
        assert answer(got.tokens[0]) == ref.tolist(), (n, case)
        assert not got.lossy


def test_unseeded_sampling_draws_from_torchs_generator(ckpt):
    """Without a seed the draws come from torch's default generator, as the published code's do:
    torch.manual_seed(s) before the call reproduces the published run seeded s."""
    folder, sd = ckpt
    engine = MosaicEngine(load(folder, device="cpu", dtype="float32"), {"progress": False})
    p = prompt_of(6, 11)
    torch.manual_seed(5)
    got = engine.generate([p], max_new_tokens=9, block_length=4, steps=4, temperature=0.9)
    torch.manual_seed(5)
    ref = llada2_generate(forward_of(sd), torch.tensor([p]), block_length=4, steps=4, gen_length=9, temperature=0.9,
                          eos_id=EOS, mask_id=MASK)
    assert answer(got.tokens[0]) == ref.tolist()


EDITING = [dict(threshold=0.7, editing_threshold=0.5),                        # LLaDA2.1's quality mode
           dict(threshold=0.5, editing_threshold=0.0),                        # its speed mode
           dict(editing_threshold=0.9, max_post_steps=2, num_to_transfer=2),
           dict(threshold=0.5, editing_threshold=0.0, max_post_steps=0),
           dict(threshold=0.6, editing_threshold=0.2, temperature=0.9, seed=4),
           dict(threshold=0.5, editing_threshold=0.1, eos_early_stop=False)]


@pytest.mark.parametrize("case", EDITING, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_llada21_editing_equals_published(ckpt, case):
    folder, sd = ckpt
    engine = MosaicEngine(load(folder, device="cpu", dtype="float32"), {"progress": False})
    seed = case.get("seed")
    ref_kw = {k: v for k, v in case.items() if k != "seed"}
    edits = 0
    for n in (3, 9):
        p = prompt_of(n, 20 + n)
        got = engine.generate([p], max_new_tokens=9, block_length=4, **case)
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        ref = llada21_generate(forward_of(sd), torch.tensor([p]), block_length=4, gen_length=9, generator=gen,
                               **ref_kw)
        assert answer(got.tokens[0]) == ref, (n, case)
        assert got.stats["editing_threshold"] == case["editing_threshold"]
        edits += got.stats["edits"]
    if case["editing_threshold"] < 0.5:
        assert edits > 0           # the case exercises token editing


def test_left_padded_batch_edits_each_as_alone(ckpt):
    folder, sd = ckpt
    engine = MosaicEngine(load(folder, device="cpu", dtype="float32"), {"progress": False})
    ps = [prompt_of(n, 40 + n) for n in (2, 9, 5)]
    got = engine.generate(ps, max_new_tokens=10, block_length=4, threshold=0.5, editing_threshold=0.0)
    for b, p in enumerate(ps):
        ref = llada21_generate(forward_of(sd), torch.tensor([p]), block_length=4, gen_length=10, threshold=0.5,
                               editing_threshold=0.0)
        assert answer(got.tokens[b]) == ref


GENERATE_21 = '''
class LLaDA2MoeModelLM:
    def generate(self, inputs=None, temperature=0.0, block_length=32, steps=32, gen_length=2048, top_p=None,
                 top_k=None, eos_early_stop=False, minimal_topk=1, threshold=0.95, editing_threshold=0.9,
                 max_post_steps=16, eos_id=156892, mask_id=156895, num_to_transfer=1):
        raise RuntimeError("read, never run")
'''
GENERATE_20 = '''
class LLaDA2MoeModelLM:
    def generate(self, inputs=None, temperature=0.0, block_length=32, steps=32, gen_length=2048, top_p=None,
                 top_k=None, eos_early_stop=False, minimal_topk=1, threshold=0.95, eos_id=156892, mask_id=156895):
        raise RuntimeError("read, never run")
'''


def test_llada21_is_chosen_as_the_checkpoints_own_generate_does(tmp_path):
    """A LLaDA2.1 checkpoint ships a generate() whose defaults edit tokens: without options Mosaic
    runs that sampler with those defaults; generation_config.json and the request override them;
    a LLaDA2.0 checkpoint's generate() has none and stays LLaDA2.0."""
    (tmp_path / "a").mkdir()
    folder, sd = checkpoint(tmp_path / "a", GENERATE_21)
    engine = MosaicEngine(load(folder, device="cpu", dtype="float32"), {"progress": False})
    p = prompt_of(6, 7)
    got = engine.generate([p], max_new_tokens=9, block_length=4)
    assert got.stats["editing_threshold"] == 0.9 and got.stats["max_post_steps"] == 16
    assert answer(got.tokens[0]) == llada21_generate(forward_of(sd), torch.tensor([p]), block_length=4, gen_length=9)
    assert engine.generate([p], max_new_tokens=9, block_length=4, editing_threshold=0.0).stats["editing_threshold"] == 0
    (tmp_path / "b").mkdir()
    folder, _ = checkpoint(tmp_path / "b", GENERATE_21, {"editing_threshold": 0.5, "max_post_steps": 3})
    got = MosaicEngine(load(folder, device="cpu", dtype="float32"), {"progress": False}).generate(
        [p], max_new_tokens=9, block_length=4)
    assert (got.stats["editing_threshold"], got.stats["max_post_steps"]) == (0.5, 3)
    (tmp_path / "c").mkdir()
    folder, sd = checkpoint(tmp_path / "c", GENERATE_20)
    got = MosaicEngine(load(folder, device="cpu", dtype="float32"), {"progress": False}).generate(
        [p], max_new_tokens=9, block_length=4, steps=4)
    assert "editing_threshold" not in got.stats
    assert answer(got.tokens[0]) == llada2_generate(forward_of(sd), torch.tensor([p]), block_length=4, steps=4,
                                                    gen_length=9, eos_id=EOS, mask_id=MASK).tolist()


def test_eos_id_and_early_stop_per_request(ckpt):
    """eos_id: the id this request stops at and is cut after; eos_early_stop=False runs every
    block (the published default) with the same answer and more forwards."""
    folder, sd = ckpt
    engine = MosaicEngine(load(folder, device="cpu", dtype="float32"), {"progress": False})
    p = prompt_of(7, 3)
    free = engine.generate([p], max_new_tokens=16, block_length=4, steps=4)
    stop = free.tokens[0, 5].item()                 # a token the answer holds early
    got = engine.generate([p], max_new_tokens=16, block_length=4, steps=4, eos_id=stop)
    ref = llada2_generate(forward_of(sd), torch.tensor([p]), block_length=4, steps=4, gen_length=16, eos_id=stop,
                          mask_id=MASK).tolist()
    t = got.tokens[0].tolist()
    assert t[: t.index(stop) + 1] == ref and got.stats["nfe"] < free.stats["nfe"]
    every = engine.generate([p], max_new_tokens=16, block_length=4, steps=4, eos_id=stop, eos_early_stop=False)
    assert every.tokens[0].tolist()[: len(ref)] == ref and every.stats["nfe"] > got.stats["nfe"]


@pytest.mark.parametrize("kw, message", [
    (dict(max_post_steps=3), "belong to LLaDA2.1's token-editing sampler"),
    (dict(num_to_transfer=2), "belong to LLaDA2.1's token-editing sampler"),
    (dict(editing_threshold=1.5), "editing_threshold must be in"),
    (dict(eos_id=48), "outside this model's vocabulary"),
])
def test_editing_refusals(ckpt, kw, message):
    engine = MosaicEngine(load(ckpt[0], device="cpu", dtype="float32"), {"progress": False})
    with pytest.raises(InputError, match=message):
        engine.generate([[1, 2, 3]], max_new_tokens=4, block_length=4, **kw)


def test_other_families_refuse_the_block_options():
    from conftest import random_model
    engine = MosaicEngine(random_model("llada"), {"progress": False})
    with pytest.raises(InputError, match="editing_threshold is a"):
        engine.generate([[1, 2, 3]], max_new_tokens=4, steps=4, editing_threshold=0.5)


def test_structured_output_and_token_editing_are_refused_together():
    """An output constraint keeps the committed answer a prefix its grammar accepts; editing
    rewrites committed tokens (policy/features.py)."""
    from mosaic.config import EngineConfig, GenerationConfig
    from mosaic.policy.features import Setting, refuse
    refuse(Setting(EngineConfig(), GenerationConfig(), "llada2", blocks=True, constrained=True))
    with pytest.raises(InputError, match="LLaDA2.1's sampler"):
        refuse(Setting(EngineConfig(), GenerationConfig(editing_threshold=0.5), "llada2", blocks=True,
                       constrained=True))
