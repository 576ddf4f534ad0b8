"""Plain re-implementations of the official iLLaDA and LLaDA2.x forwards and of LLaDA2's
generate(), for the tests only, written from the published code (sharing no code with mosaic):

  iLLaDA   modeling_illada.py (ILLaDAForCausalLM: RMSNorm, RoPE tables cast to the model dtype,
           GQA by repeat_kv, SDPA with the 2-D attention_mask as an additive key mask, SwiGLU,
           tied head); its sampler is LLaDA's generate.py with mask_id=5 (tests/official.py)
  LLaDA2   modeling_llada2_moe.py (inclusionAI/dFactory 49c315c; the hub's LLaDA2.0-mini copy):
           fused query_key_value, q/k RMSNorm, partial RoPE, SDPA with a 4-D additive mask,
           LLaDA2MoeGate (sigmoid, expert bias, group-limited top-k, normalised, scaled),
           moe_infer (argsort, new_x[idxs] = outs, fp32 weighted .sum(dim=1)), shared experts,
           dense first layers, fp32 logits; generate() (block diffusion, batch of one)

Checkpoints are state dicts in the official key names with a config.json in the official field
names (tiny, random)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms(x, w, eps):
    dt = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dt)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def cos_sin(pos, dim, theta, dtype):
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = (inv[None, :, None].float() @ pos[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope(q, k, cos, sin):
    """Partial RoPE as apply_rotary_pos_emb: the first cos.shape[-1] dims rotate."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    qr, qp, kr, kp = q[..., :r], q[..., r:], k[..., :r], k[..., r:]
    return (torch.cat([qr * cos + rotate_half(qr) * sin, qp], -1),
            torch.cat([kr * cos + rotate_half(kr) * sin, kp], -1))


def repeat_kv(t, n):
    b, h, s, d = t.shape
    return t if n == 1 else t[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def lin(x, sd, key):
    b = sd.get(key[:-len("weight")] + "bias")
    return F.linear(x, sd[key], b)


def mlp(sd, p, x):
    return lin(F.silu(lin(x, sd, p + "gate_proj.weight")) * lin(x, sd, p + "up_proj.weight"), sd,
               p + "down_proj.weight")


# -- iLLaDA
def illada_forward(sd, raw, ids, attention_mask=None):
    """Logits [B, L, V] of ILLaDAForCausalLM (attention_mask [B, L] 1 = token, or None)."""
    B, L = ids.shape
    d, H, Hkv = raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"]
    hd, eps = d // H, raw["rms_norm_eps"]
    x = sd["model.embed_tokens.weight"][ids]
    dt = x.dtype
    mask = None
    if attention_mask is not None:
        allowed = attention_mask.bool()[:, None, None, :]
        mask = torch.zeros(allowed.shape, dtype=dt).masked_fill(~allowed, torch.finfo(dt).min)
    pos = torch.arange(L).unsqueeze(0).expand(B, -1)
    cos, sin = cos_sin(pos, hd, raw["rope_theta"], dt)
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"], eps)
        q = lin(h, sd, p + "self_attn.q_proj.weight").view(B, L, H, hd).transpose(1, 2)
        k = lin(h, sd, p + "self_attn.k_proj.weight").view(B, L, Hkv, hd).transpose(1, 2)
        v = lin(h, sd, p + "self_attn.v_proj.weight").view(B, L, Hkv, hd).transpose(1, 2)
        q, k = rope(q, k, cos, sin)
        k, v = repeat_kv(k, H // Hkv), repeat_kv(v, H // Hkv)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        x = x + lin(o.transpose(1, 2).reshape(B, L, -1), sd, p + "self_attn.o_proj.weight")
        x = x + mlp(sd, p + "mlp.", rms(x, sd[p + "post_attention_layernorm.weight"], eps))
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])      # tied
    return F.linear(rms(x, sd["model.norm.weight"], eps), head)


# -- LLaDA2
def gate(sd, p, raw, h):
    n = h.shape[0]
    E, k = raw["num_experts"], raw["num_experts_per_tok"]
    G, TG = raw.get("n_group", 1), raw.get("topk_group", 1)
    logits = F.linear(h.type(torch.float32), sd[p + "weight"].type(torch.float32))
    if raw.get("score_function", "sigmoid") == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
    else:   # mlx-lm's reading of score_function (the PyTorch code always uses sigmoid)
        scores = torch.softmax(logits.float(), dim=-1).type_as(logits)
    route = scores + sd[p + "expert_bias"]
    group_scores = route.view(n, G, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=TG, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(n, G, E // G).reshape(n, -1)
    masked = route.masked_fill(~score_mask.bool(), float("-inf"))
    _, topk_idx = torch.topk(masked, k=k, dim=-1)
    w = torch.gather(scores, dim=1, index=topk_idx).type_as(logits)
    if k > 1 and raw.get("norm_topk_prob", True):
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_idx, w * raw["routed_scaling_factor"]


def moe(sd, p, raw, h3):
    B, L, d = h3.shape
    x = h3.view(-1, d)
    topk_ids, topk_weight = gate(sd, p + "gate.", raw, x)
    cnts = topk_ids.new_zeros((topk_ids.shape[0], raw["num_experts"]))
    cnts.scatter_(1, topk_ids, 1)
    tokens_per_expert = cnts.sum(dim=0).tolist()
    idxs = topk_ids.view(-1).argsort()
    sorted_tokens = x[idxs // topk_ids.shape[1]]
    outputs, start = [], 0
    for i, num in enumerate(tokens_per_expert):
        if num == 0:
            continue
        outputs.append(mlp(sd, f"{p}experts.{i}.", sorted_tokens[start:start + num]))
        start += num
    outs = torch.cat(outputs, dim=0)
    new_x = torch.empty_like(outs)
    new_x[idxs] = outs
    y = new_x.view(*topk_ids.shape, -1).type(topk_weight.dtype).mul_(topk_weight.unsqueeze(-1)).sum(dim=1)
    y = y.type(new_x.dtype).view(B, L, d)
    if raw.get("num_shared_experts"):
        y = y + mlp(sd, p + "shared_experts.", h3)
    return y


def llada2_forward(sd, raw, ids, attention_mask=None, position_ids=None):
    """Logits [B, L, V] (float32) of LLaDA2MoeModelLM; attention_mask: a 4-D additive mask
    [B, 1, L, L] (0 / -inf) or None (bidirectional); position_ids [B, L] (default arange)."""
    B, L = ids.shape
    d, H, Hkv = raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"]
    hd = raw.get("head_dim") or d // H
    rot = int(hd * raw.get("partial_rotary_factor", 1.0))
    eps = raw["rms_norm_eps"]
    x = sd["model.word_embeddings.weight"][ids]
    dt = x.dtype
    pos = torch.arange(L).unsqueeze(0) if position_ids is None else position_ids
    cos, sin = cos_sin(pos, rot, raw["rope_theta"], dt)
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"], eps)
        qkv = lin(h, sd, p + "attention.query_key_value.weight").view(B, L, H + 2 * Hkv, hd)
        q, k, v = (t.transpose(1, 2) for t in qkv.split([H, Hkv, Hkv], dim=-2))
        if raw.get("use_qk_norm", True):
            q = rms(q, sd[p + "attention.query_layernorm.weight"], eps)
            k = rms(k, sd[p + "attention.key_layernorm.weight"], eps)
        q, k = rope(q, k, cos, sin)
        o = F.scaled_dot_product_attention(q, repeat_kv(k, H // Hkv), repeat_kv(v, H // Hkv),
                                           attn_mask=attention_mask, scale=hd ** -0.5)
        x = x + lin(o.transpose(1, 2).reshape(B, L, -1), sd, p + "attention.dense.weight")
        h = rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        if i < raw.get("first_k_dense_replace", 0):
            x = x + mlp(sd, p + "mlp.", h)
        else:
            x = x + moe(sd, p + "mlp.", raw, h)
    head = sd.get("lm_head.weight", sd["model.word_embeddings.weight"])
    return F.linear(rms(x, sd["model.norm.weight"], eps), head).float()


def block_mask(num_blocks, block_length, dtype):
    """The published block-diffusion mask: 0 where the key's block <= the query's, else -inf."""
    m = torch.tril(torch.ones(num_blocks, num_blocks))
    m = m.repeat_interleave(block_length, 0).repeat_interleave(block_length, 1)[None, None].bool()
    return torch.where(m, 0.0, float("-inf")).to(dtype)


def sample(logits, temperature, top_k, top_p, generator=None):
    """_sample_with_temperature_topk_topp: greedy at temperature 0 (the later published copy),
    else temperature, top-k, top-p and one multinomial draw."""
    shape = logits.shape[:-1]
    logits = logits.reshape(-1, logits.shape[-1])
    if temperature == 0:
        token = logits.argmax(dim=-1, keepdim=True)
        probs = F.softmax(logits, dim=-1)
    else:
        logits = logits / temperature
        if top_k is not None and top_k > 0:
            kth = torch.topk(logits, top_k)[0][..., -1, None]
            logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
        if top_p is not None and top_p < 1.0:
            srt, order = torch.sort(logits, descending=True)
            cum = torch.cumsum(F.softmax(srt, dim=-1), dim=-1)
            drop = cum > top_p
            drop[..., 1:] = drop[..., :-1].clone()
            drop[..., 0] = False
            logits = logits.masked_fill(torch.scatter(torch.zeros_like(logits, dtype=torch.bool), -1, order, drop),
                                        float("-inf"))
        probs = F.softmax(logits, dim=-1)
        token = torch.multinomial(probs, num_samples=1, generator=generator)
    return token.view(*shape), torch.gather(probs, -1, token).view(*shape)


def transfer_schedule(block_length, steps):
    base, rem = block_length // steps, block_length % steps
    out = torch.full((steps,), base, dtype=torch.int64)
    out[:rem] += 1
    return out


@torch.no_grad()
def llada2_generate(forward, prompt, temperature=0.0, block_length=32, steps=32, gen_length=2048, top_p=None,
                    top_k=None, minimal_topk=1, threshold=0.95, eos_id=156892, mask_id=156895, generator=None,
                    dtype=torch.float32):
    """The published generate() for one prompt [1, P]: the answer up to and including its
    first eos_id (or gen_length tokens). forward(ids, mask4d, position_ids) -> logits."""
    steps = min(steps, gen_length // minimal_topk)
    P = prompt.shape[1]
    num_blocks = (P + gen_length + block_length - 1) // block_length
    total = num_blocks * block_length
    mask4 = block_mask(num_blocks, block_length, dtype)
    position_ids = torch.arange(total).unsqueeze(0)
    x = torch.full((1, total), mask_id, dtype=torch.long)
    x[:, :P] = prompt
    schedule = transfer_schedule(block_length, steps)
    for nb in range(P // block_length, num_blocks):
        end = (nb + 1) * block_length
        cur = x[:, :end]
        for step in range(steps):
            active = cur[:, -block_length:] == mask_id
            if active.sum() == 0:
                break
            logits = forward(cur, mask4[:, :, :end, :end], position_ids[:, :end])
            x0, x0_p = sample(logits[:, -block_length:, :], temperature, top_k, top_p, generator)
            k = int(schedule[step])
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            conf = torch.where(active, x0_p, -torch.inf)
            high = conf[0] > threshold
            if int(high.sum()) >= k:
                transfer[0] = high
            else:
                _, idx = torch.topk(conf[0], k=min(k, int(active.sum())))
                transfer[0, idx] = True
            if transfer.any():
                cur[:, -block_length:][transfer] = x0[transfer]
        if eos_id is not None and bool((x[0, P:end] == eos_id).any()):
            break
    ans = x[0, P:P + gen_length]
    hits = (ans == eos_id).nonzero()
    n = int(hits[0]) + 1 if len(hits) else gen_length
    return ans[:n]


# -- tiny checkpoints in the official names
def random_state(keys: dict[str, tuple], seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random tensors for {key: shape}: norms near 1, embeddings N(0, 1), the rest scaled."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, shape in keys.items():
        if "norm" in k:
            t = 1 + 0.1 * torch.randn(shape, generator=g)
        elif "embed" in k:
            t = torch.randn(shape, generator=g)
        elif k.endswith("expert_bias"):
            t = 0.05 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        out[k] = t.to(dtype)
    return out


def illada_keys(raw) -> dict[str, tuple]:
    d, F_, V = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"]
    H, Hkv = raw["num_attention_heads"], raw["num_key_value_heads"]
    hd = d // H
    keys = {"model.embed_tokens.weight": (V, d), "model.norm.weight": (d,)}
    if not raw.get("tie_word_embeddings", True):
        keys["lm_head.weight"] = (V, d)
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        keys |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                 p + "self_attn.q_proj.weight": (H * hd, d), p + "self_attn.k_proj.weight": (Hkv * hd, d),
                 p + "self_attn.v_proj.weight": (Hkv * hd, d), p + "self_attn.o_proj.weight": (d, d),
                 p + "mlp.gate_proj.weight": (F_, d), p + "mlp.up_proj.weight": (F_, d),
                 p + "mlp.down_proj.weight": (d, F_)}
        if raw.get("attention_bias"):
            keys |= {p + "self_attn.q_proj.bias": (H * hd,), p + "self_attn.k_proj.bias": (Hkv * hd,),
                     p + "self_attn.v_proj.bias": (Hkv * hd,), p + "self_attn.o_proj.bias": (d,)}
    return keys


def llada2_keys(raw) -> dict[str, tuple]:
    d, V = raw["hidden_size"], raw["vocab_size"]
    H, Hkv = raw["num_attention_heads"], raw["num_key_value_heads"]
    hd = raw.get("head_dim") or d // H
    E, Fm = raw["num_experts"], raw["moe_intermediate_size"]
    keys = {"model.word_embeddings.weight": (V, d), "model.norm.weight": (d,)}
    if not raw.get("tie_word_embeddings", False):
        keys["lm_head.weight"] = (V, d)
    for i in range(raw["num_hidden_layers"]):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.attention.", f"model.layers.{i}.mlp."
        keys |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                 a + "query_key_value.weight": ((H + 2 * Hkv) * hd, d), a + "dense.weight": (d, H * hd)}
        if raw.get("use_qkv_bias"):
            keys[a + "query_key_value.bias"] = ((H + 2 * Hkv) * hd,)
        if raw.get("use_bias"):
            keys[a + "dense.bias"] = (d,)
        if raw.get("use_qk_norm", True):
            keys |= {a + "query_layernorm.weight": (hd,), a + "key_layernorm.weight": (hd,)}
        if i < raw.get("first_k_dense_replace", 0):
            Fd = raw["intermediate_size"]
            keys |= {m + "gate_proj.weight": (Fd, d), m + "up_proj.weight": (Fd, d), m + "down_proj.weight": (d, Fd)}
            continue
        keys |= {m + "gate.weight": (E, d), m + "gate.expert_bias": (E,)}
        S = Fm * (raw.get("num_shared_experts") or 0)
        if S:
            keys |= {m + "shared_experts.gate_proj.weight": (S, d), m + "shared_experts.up_proj.weight": (S, d),
                     m + "shared_experts.down_proj.weight": (d, S)}
        for j in range(E):
            e = f"{m}experts.{j}."
            keys |= {e + "gate_proj.weight": (Fm, d), e + "up_proj.weight": (Fm, d), e + "down_proj.weight": (d, Fm)}
    return keys


TINY_ILLADA = {
    "model_type": "illada", "architectures": ["ILLaDAForCausalLM"], "hidden_size": 32, "intermediate_size": 56,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 40,
    "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "layer_norm_eps": None,
    "attention_dropout": 0.0, "resid_pdrop": 0.0, "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1,
    "initializer_range": 0.02, "use_cache": False, "torch_dtype": "bfloat16",
}

TINY_LLADA2 = {
    "model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"], "hidden_size": 32, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
    "moe_intermediate_size": 12, "num_experts": 8, "num_experts_per_tok": 3, "num_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2, "score_function": "sigmoid", "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "moe_router_enable_expert_bias": True, "use_qk_norm": True, "use_qkv_bias": False,
    "use_bias": False, "partial_rotary_factor": 0.5, "rotary_dim": 4, "vocab_size": 48, "rope_theta": 600000.0,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "tie_word_embeddings": False, "hidden_act": "silu",
    "norm_head": False, "norm_softmax": False, "use_rmsnorm": True, "router_dtype": "fp32", "pad_token_id": 45,
    "eos_token_id": 45, "mask_token_id": 47, "use_sliding_window": False, "max_window_layers": 28,
    "output_router_logits": False, "embedding_dropout": 0.0, "attention_dropout": 0.0, "output_dropout": 0.0,
    "initializer_range": 0.02, "use_cache": False, "torch_dtype": "bfloat16",
    "using_split_qkv_in_self_attention": False,
}
