"""SDAR as a family record (mosaic/models/families/sdar.py): config.json in SDAR's field names,
its forward against a plain re-implementation of modeling_sdar.py (Qwen3 with per-head q/k
norms), and its published sampler — block_diffusion_generate of JetAstra/SDAR generate.py,
re-implemented plainly below — token for token on tiny random checkpoints (CPU, float32),
greedy and seeded, with the preset sized by `mosaic plan`."""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from plain_families import cos_sin, lin, mlp, random_state, repeat_kv, rms, rope
from safetensors.torch import save_file

from mosaic import MosaicEngine, load
from mosaic.checkpoint_fields import ConfigFieldWarning
from mosaic.cli import main
from mosaic.errors import CheckpointError
from mosaic.models.families import config_from_hf, family_of
from mosaic.runtime.runner import NativeRunner

MASK, EOS, IM_END = 49, 47, 48
# the SDAR-4B-Chat config.json field names (training/model/SDAR-4B-Chat/config.json), tiny sizes;
# head_dim 16 is not hidden / heads, as in Qwen3
TINY_SDAR = {
    "architectures": ["SDARForCausalLM"], "auto_map": {"AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
    "attention_bias": False, "attention_dropout": 0.0, "attn_implementation": "flex_attention", "bos_token_id": 46,
    "debug": False, "eos_token_id": EOS, "block_size": 4, "mask_token_id": MASK, "ep_size": 1,
    "fuse_cross_entropy": True, "head_dim": 16, "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02,
    "intermediate_size": 48, "max_position_embeddings": 512, "max_window_layers": 2, "micro_forward": False,
    "model_type": "sdar", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000, "skip_checkpoint": False,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.52.4", "use_cache": False, "use_deepep": False, "use_sliding_window": False,
    "vocab_size": 50}
GENERATION_CONFIG = {"bos_token_id": 46, "do_sample": True, "eos_token_id": [IM_END, EOS], "pad_token_id": EOS,
                     "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def sdar_keys(raw):
    d, f, v, hd = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"], raw["head_dim"]
    h, kv = raw["num_attention_heads"], raw["num_key_value_heads"]
    keys = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not raw["tie_word_embeddings"]:
        keys["lm_head.weight"] = (v, d)
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        keys |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                 p + "self_attn.q_proj.weight": (h * hd, d), p + "self_attn.k_proj.weight": (kv * hd, d),
                 p + "self_attn.v_proj.weight": (kv * hd, d), p + "self_attn.o_proj.weight": (d, h * hd),
                 p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                 p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                 p + "mlp.down_proj.weight": (d, f)}
        if raw["attention_bias"]:           # SDARAttention: bias=attention_bias on q, k, v and o
            keys |= {p + "self_attn.q_proj.bias": (h * hd,), p + "self_attn.k_proj.bias": (kv * hd,),
                     p + "self_attn.v_proj.bias": (kv * hd,), p + "self_attn.o_proj.bias": (d,)}
    return keys


def sdar_forward(sd, raw, ids, mask=None, position_ids=None):
    """SDARForCausalLM's logits [B, L, V] (modeling_sdar.py: Qwen3 attention with q_norm / k_norm
    on the head dim before RoPE); mask: [1, L, L] bool (True: attend) or None (bidirectional)."""
    B, L = ids.shape
    H, Hkv, hd, eps = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"], raw["rms_norm_eps"]
    x = sd["model.embed_tokens.weight"][ids]
    pos = torch.arange(L)[None] if position_ids is None else position_ids
    cos, sin = cos_sin(pos, hd, raw["rope_theta"], x.dtype)
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        h = rms(x, sd[f"model.layers.{i}.input_layernorm.weight"], eps)
        q = rms(lin(h, sd, p + "q_proj.weight").view(B, L, H, hd), sd[p + "q_norm.weight"], eps).transpose(1, 2)
        k = rms(lin(h, sd, p + "k_proj.weight").view(B, L, Hkv, hd), sd[p + "k_norm.weight"], eps).transpose(1, 2)
        v = lin(h, sd, p + "v_proj.weight").view(B, L, Hkv, hd).transpose(1, 2)
        q, k = rope(q, k, cos, sin)
        o = F.scaled_dot_product_attention(q, repeat_kv(k, H // Hkv), repeat_kv(v, H // Hkv),
                                           attn_mask=None if mask is None else mask[:, None], scale=hd ** -0.5)
        x = x + lin(o.transpose(1, 2).reshape(B, L, -1), sd, p + "o_proj.weight")
        x = x + mlp(sd, f"model.layers.{i}.mlp.", rms(x, sd[f"model.layers.{i}.post_attention_layernorm.weight"], eps))
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return F.linear(rms(x, sd["model.norm.weight"], eps), head)


def sample(logits, temperature, top_k, top_p, generator):
    """sample_with_temperature_topk_topp; temperature 0 takes the argmax (the published code
    divides by it: docs/MODELS.md)."""
    logits = logits.reshape(-1, logits.shape[-1])
    if temperature == 0:
        token = logits.argmax(-1, keepdim=True)
        probs = F.softmax(logits, dim=-1)
        return token.view(1, -1), torch.gather(probs, -1, token).view(1, -1)
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 0:
        logits = torch.where(logits < torch.topk(logits, top_k)[0][..., -1, None], -torch.inf, logits)
    if top_p < 1.0:
        srt, idx = torch.sort(logits, descending=True)
        drop = torch.cumsum(F.softmax(srt, dim=-1), dim=-1) > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), -torch.inf)
    probs = F.softmax(logits, dim=-1)
    token = torch.multinomial(probs, num_samples=1, generator=generator)
    return token.view(1, -1), torch.gather(probs, -1, token).view(1, -1)


@torch.no_grad()
def sdar_generate(forward, prompt, gen_length, block_length=4, denoising_steps=4, temperature=1.0, top_k=0,
                  top_p=1.0, remasking_strategy="low_confidence_dynamic", confidence_threshold=0.85,
                  stopping_criteria_idx=(IM_END, EOS), generator=None):
    """block_diffusion_generate (generate.py) for one prompt [1, P]: the whole canvas. Its KV cache
    holds the finished blocks' K/V, so each step is the forward of the window up to the current
    block under the block-causal mask, keeping the current block's logits."""
    P = prompt.shape[1]
    nb = (P + gen_length + block_length - 1) // block_length
    mask = torch.tril(torch.ones(nb, nb)).repeat_interleave(block_length, 0).repeat_interleave(block_length, 1)
    mask, pos = mask.bool()[None], torch.arange(nb * block_length)[None]
    x = torch.full((1, nb * block_length), MASK, dtype=torch.long)
    x[:, :P] = prompt
    ntt = torch.zeros(denoising_steps, dtype=torch.int64) + block_length // denoising_steps
    ntt[:block_length % denoising_steps] += 1
    for b in range(P // block_length, nb):
        lo, hi = b * block_length, (b + 1) * block_length
        cur = x[:, lo:hi].clone()
        for step in range(denoising_steps + 1):
            mi = cur == MASK
            if mi.sum() == 0:
                break
            logits = forward(torch.cat([x[:, :lo], cur], 1), mask[:, :hi, :hi], pos[:, :hi])[:, lo:]
            x0, x0_p = sample(logits, temperature, top_k, top_p, generator)
            conf = torch.where(mi, x0_p, -torch.inf)
            take = torch.zeros_like(x0, dtype=torch.bool)
            high = conf[0] > confidence_threshold
            if remasking_strategy == "low_confidence_dynamic" and high.sum() >= ntt[step]:
                take[0] = high
            else:                                   # low_confidence_static, or too few above it
                take[0, torch.topk(conf[0], int(ntt[step]))[1]] = True
            cur[take] = x0[take]
        x[:, lo:hi] = cur
        if any(i in x[:, P:] for i in stopping_criteria_idx):
            break
    return x


def write(folder, raw=TINY_SDAR, seed=1):
    folder.mkdir(parents=True, exist_ok=True)
    sd = random_state(sdar_keys(raw), seed)
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return folder, sd


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write(tmp_path_factory.mktemp("sdar"))


def engine_of(folder):
    with warnings.catch_warnings():      # generation_config.json's AR sampling fields: left out, named
        warnings.simplefilter("ignore", ConfigFieldWarning)
        return MosaicEngine(load(folder, device="cpu", dtype="float32"), {"progress": False})


def test_sdar_parses_by_its_field_names():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigFieldWarning)      # every published field is known
        cfg = config_from_hf(TINY_SDAR)
    assert cfg.family == "sdar" and cfg.block_causal and cfg.qk_norm and not cfg.tied
    assert (cfg.head_dim, cfg.q_dim, cfg.kv_dim, cfg.mask_id, cfg.eos_id) == (16, 64, 32, MASK, EOS)
    assert family_of(cfg).samplers.exact == "block_diffusion"


@pytest.mark.parametrize("change, word", [({"use_sliding_window": True}, "use_sliding_window"),
                                          ({"hidden_act": "gelu"}, "hidden_act"),
                                          ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling")])
def test_sdar_refuses_what_it_does_not_run(change, word):
    with pytest.raises(CheckpointError, match=word):
        config_from_hf(TINY_SDAR | change)


@pytest.mark.parametrize("change", [{}, {"tie_word_embeddings": True}, {"attention_bias": True}])
def test_sdar_forward_matches_modeling_sdar(tmp_path, change):
    raw = TINY_SDAR | change
    folder, sd = write(tmp_path / "m", raw)
    model = engine_of(folder).model
    ids = torch.randint(0, 46, (2, 13), generator=torch.Generator().manual_seed(5))
    ours, ref = NativeRunner(model).forward(ids, None), sdar_forward(sd, raw, ids)
    assert float((ours - ref).norm() / ref.norm()) < 1e-5


def answer(x, P, G):
    """The published canvas's answer up to and including its first stop id."""
    t = x[0, P:P + G].tolist()
    stops = [i for i, v in enumerate(t) if v in (IM_END, EOS)]
    return t[: stops[0] + 1] if stops else t


def ours(tokens):
    t = tokens.tolist()
    stops = [i for i, v in enumerate(t) if v in (IM_END, EOS)]
    return t[: stops[0] + 1] if stops else t


CASES = [dict(temperature=0.0),                                               # greedy, block 4 / steps 4 (README)
         dict(temperature=1.0, seed=1),                                       # generate.py's defaults
         dict(temperature=0.7, top_k=6, top_p=0.9, seed=2),
         dict(temperature=0.0, confidence_threshold=0.3),
         dict(temperature=0.0, remasking_strategy="low_confidence_static"),   # = threshold 1.0
         dict(temperature=0.0, denoising_steps=2, confidence_threshold=0.99),  # 2 per step: top-k may rewrite
         dict(temperature=1.0, block_length=8, denoising_steps=3, seed=3)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_sdar_tokens_equal_block_diffusion_generate(ckpt, case):
    folder, sd = ckpt
    engine = engine_of(folder)
    case = dict(case)
    seed = case.pop("seed", None)
    bl, steps = case.pop("block_length", 4), case.pop("denoising_steps", 4)
    static = case.pop("remasking_strategy", None) is not None
    thr = 1.0 if static else case.pop("confidence_threshold", 0.85)
    calls = []

    def fwd(ids, m, pos):
        calls.append(1)
        return sdar_forward(sd, TINY_SDAR, ids, m, pos)

    for n in (3, 6, 9):
        calls.clear()
        p = torch.randint(0, 46, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        got = engine.generate([p], max_new_tokens=10, block_length=bl, steps=steps, threshold=thr, seed=seed,
                              temperature=case["temperature"], top_k=case.get("top_k"), top_p=case.get("top_p"))
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        ref = sdar_generate(fwd, torch.tensor([p]), 10, bl, steps, case["temperature"], case.get("top_k", 0),
                            case.get("top_p", 1.0), "low_confidence_static" if static else "low_confidence_dynamic",
                            thr if not static else 0.85, generator=gen)
        assert ours(got.tokens[0]) == answer(ref, n, 10), (n, case)
        assert got.stats["nfe"] == len(calls), (n, case)   # the same steps: it stops where generate.py does


def test_sdar_defaults_come_from_the_checkpoint(ckpt):
    """config.json's block_size is the default block; generation_config.json's autoregressive
    sampling fields are left out (generate.py reads only its end-of-text ids), and both of those
    end the answer."""
    engine = engine_of(ckpt[0])
    gen = engine.requests.generation_config()
    assert gen.block_length == 4 and gen.temperature == 0.0 and gen.top_k is None
    assert set(engine.model.cfg.extra_eos_ids) | {engine.model.cfg.eos_id} == {EOS, IM_END}


def test_sdar_refuses_llada21_editing(ckpt):
    from mosaic.errors import InputError
    with pytest.raises(InputError, match="editing_threshold: LLaDA2.1's token-editing options; the published SDAR"):
        engine_of(ckpt[0]).generate([[1, 2, 3]], max_new_tokens=4, editing_threshold=0.5)


def test_plan_sizes_the_sdar_presets(capsys):
    """mosaic plan on the published geometry: SDAR-8B's weights are 16.4 GB in bfloat16 (8.2B
    parameters, untied head), and a 40 GiB budget holds a long request."""
    assert main(["plan", "--model", "sdar-8b", "--budget", "40GiB", "--device", "cuda", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 16.3e9 < out["weights_bytes"] < 16.5e9, out["weights_bytes"]
    assert out["kv_cache_bytes_per_token"] == 2 * 36 * 8 * 128 * 2       # the block store, bfloat16
    assert out["l_max"] > 100_000, out["l_max"]
    w4 = load("sdar-4b", device="meta").weight_bytes() / 2 / 1e9
    assert 4.3 < w4 < 4.5, w4


def test_sdar_requests_stack_in_the_scheduler_with_their_tokens_alone(ckpt):
    """SDAR's block steps of equal rows stack across requests (one step over the paged pool,
    engine/batching.RoundExecutor) and each request gets its tokens alone (greedy, float32)."""
    from mosaic.engine.scheduler import Scheduler
    engine = engine_of(ckpt[0])
    prompts = [[3, 1, 4, 1, 5, 9, 2], [3, 5], [8, 9, 7, 9]]
    opts = dict(max_new_tokens=8, block_length=4, steps=4, temperature=0.0)
    ref = [engine.generate([p], **opts).tokens for p in prompts]
    sched = Scheduler(engine)
    runs = [engine.start(engine.request([p], **opts)) for p in prompts]
    for run in runs:
        sched.add(run)
    ended = {id(f.run): f for f in sched.run_all()}
    for run, want in zip(runs, ref):
        assert ended[id(run)].error is None and torch.equal(ended[id(run)].generation.tokens, want)
    assert sched.stats.stacked_steps > 0 and not sched.stats.fallbacks, sched.stats.as_dict()
