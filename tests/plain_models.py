"""An independent, deliberately plain forward of the three families, straight from MODELS.md and
the published checkpoint keys. It shares no code with mosaic: it is the oracle of the tests."""

from __future__ import annotations

import math

import torch


def rms(x, w, eps):
    dt = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dt)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def rope(x, pos, rot, theta, fp32):
    """x [B, H, L, D]; pos [B, L]. Rotates the first `rot` dims of each head."""
    inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    f = pos.float()[..., None] * inv                       # [B, L, rot/2]
    emb = torch.cat([f, f], dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]       # [B, 1, L, rot]
    xr, xp = x[..., :rot], x[..., rot:]
    if fp32:
        out = (xr.float() * cos + rotate_half(xr.float()) * sin).to(x.dtype)
    else:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        out = xr * cos + rotate_half(xr) * sin
    return torch.cat([out, xp], dim=-1)


def attend(q, k, v, mask):
    """q [B, H, L, D]; k, v [B, Hkv, L, D]; mask [B, 1 or L, L] bool or None."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask[:, None], -torch.inf)
    p = torch.nan_to_num(torch.softmax(s, dim=-1))        # a fully masked row attends to nothing
    return (p @ v.float()).to(q.dtype)


def forward(sd: dict, raw: dict, ids: torch.Tensor, valid: torch.Tensor | None = None):
    """Logits [B, L, V] of a checkpoint given as its state dict and config.json dict."""
    B, L = ids.shape
    mtype = raw["model_type"].lower()
    moe = "num_experts" in raw
    if mtype == "llada" and not moe:
        p = "model.transformer."
        d, H = raw["d_model"], raw["n_heads"]
        Hkv, nl, eps = raw.get("n_kv_heads", H), raw["n_layers"], raw["rms_norm_eps"]
        names = lambda i: {  # noqa: E731
            "n1": f"{p}blocks.{i}.attn_norm.weight", "q": f"{p}blocks.{i}.q_proj.weight",
            "k": f"{p}blocks.{i}.k_proj.weight", "v": f"{p}blocks.{i}.v_proj.weight",
            "o": f"{p}blocks.{i}.attn_out.weight", "n2": f"{p}blocks.{i}.ff_norm.weight",
            "g": f"{p}blocks.{i}.ff_proj.weight", "u": f"{p}blocks.{i}.up_proj.weight",
            "dn": f"{p}blocks.{i}.ff_out.weight"}
        emb, nf, head = sd[p + "wte.weight"], sd[p + "ln_f.weight"], sd[p + "ff_out.weight"]
        fp32, rot = True, d // H
    else:
        d, H = raw["hidden_size"], raw["num_attention_heads"]
        Hkv, nl, eps = raw["num_key_value_heads"], raw["num_hidden_layers"], raw["rms_norm_eps"]
        names = lambda i: {  # noqa: E731
            "n1": f"model.layers.{i}.input_layernorm.weight",
            "q": f"model.layers.{i}.self_attn.q_proj.weight",
            "k": f"model.layers.{i}.self_attn.k_proj.weight",
            "v": f"model.layers.{i}.self_attn.v_proj.weight",
            "o": f"model.layers.{i}.self_attn.o_proj.weight",
            "n2": f"model.layers.{i}.post_attention_layernorm.weight",
            "g": f"model.layers.{i}.mlp.gate_proj.weight", "u": f"model.layers.{i}.mlp.up_proj.weight",
            "dn": f"model.layers.{i}.mlp.down_proj.weight"}
        emb, nf, head = sd["model.embed_tokens.weight"], sd["model.norm.weight"], sd["lm_head.weight"]
        fp32 = False
        hd = raw.get("head_dim", d // H)
        rot = int(hd * raw.get("partial_rotary_factor", 1.0))
    hd = raw.get("head_dim", d // H)
    theta = raw["rope_theta"]
    pos = torch.arange(L).expand(B, L)
    mask = None
    if valid is not None and not bool(valid.all()):
        if mtype == "dream":
            pos = (valid.long().cumsum(-1) - 1).masked_fill(~valid, 1)
            mask = valid[:, None, :] & valid[:, :, None]
        else:  # LLaDA; LLaDA-MoE too, where Mosaic deviates from the published code (docs/MODELS.md)
            mask = valid[:, None, :].expand(B, 1, L)
    x = emb[ids]
    for i in range(nl):
        w = names(i)
        h = rms(x, sd[w["n1"]], eps)
        lin = lambda t, key: t @ sd[key].T + (sd[key[:-6] + "bias"] if key[:-6] + "bias" in sd else 0)  # noqa
        q = lin(h, w["q"]).view(B, L, H, hd).transpose(1, 2)
        k = lin(h, w["k"]).view(B, L, Hkv, hd).transpose(1, 2)
        v = lin(h, w["v"]).view(B, L, Hkv, hd).transpose(1, 2)
        if moe and raw.get("qk_layernorm", True):
            q = rms(q, sd[f"model.layers.{i}.self_attn.q_norm.weight"], eps)
            k = rms(k, sd[f"model.layers.{i}.self_attn.k_norm.weight"], eps)
        q, k = rope(q, pos, rot, theta, fp32), rope(k, pos, rot, theta, fp32)
        o = attend(q, k, v, mask).transpose(1, 2).reshape(B, L, H * hd)
        x = x + o @ sd[w["o"]].T
        h = rms(x, sd[w["n2"]], eps)
        if moe:
            x = x + moe_ffn(sd, raw, i, h)
        else:
            x = x + (torch.nn.functional.silu(h @ sd[w["g"]].T) * (h @ sd[w["u"]].T)) @ sd[w["dn"]].T
    return rms(x, nf, eps) @ head.T


def moe_ffn(sd, raw, i, h):
    """The OLMoE-style loop: softmax router in fp32, top-k without renormalisation, experts in id
    order accumulated with index_add into zeros."""
    B, L, d = h.shape
    E, k = raw["num_experts"], raw["num_experts_per_tok"]
    flat = h.reshape(-1, d)
    logits = flat @ sd[f"model.layers.{i}.mlp.gate.weight"].T
    probs = torch.softmax(logits, dim=1, dtype=torch.float)
    w, sel = torch.topk(probs, k, dim=-1)
    w = w.to(h.dtype)
    out = torch.zeros_like(flat)
    onehot = torch.nn.functional.one_hot(sel, E).permute(2, 1, 0)
    for e in range(E):
        slot, tok = torch.where(onehot[e])
        if tok.numel() == 0:
            continue
        p = f"model.layers.{i}.mlp.experts.{e}."
        xe = flat[tok]
        ye = (torch.nn.functional.silu(xe @ sd[p + "gate_proj.weight"].T) * (xe @ sd[p + "up_proj.weight"].T)) \
            @ sd[p + "down_proj.weight"].T
        out.index_add_(0, tok, ye * w[tok, slot, None])
    return out.view(B, L, d)
