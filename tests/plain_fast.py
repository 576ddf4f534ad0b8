"""Plain re-implementations of Fast-dLLM's published accelerated samplers, for the tests only.

Written from the published code's behaviour (NVlabs/Fast-dLLM llada/generate.py, llada/model/
modeling_llada.py, dream/model/generation_utils_block.py, generation_utils.py, modeling_dream.py;
docs/FAST_DECODING.md pins the versions), sharing no code with mosaic: the model keeps K and V
before RoPE, concatenates the prefix cache or overwrites the dual cache in place, and rotates the
whole key range at every call, exactly as the published models do. Random draws take an explicit
torch.Generator (the published code uses the global one: the same stream for the same seed).

A loop that would never end in the published code (a committed mask id the model keeps
predicting) raises Spin after SPIN_LIMIT forwards instead."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plain_models import attend, rms, rope

SPIN_LIMIT = 400


class Spin(RuntimeError):
    """The published loop would not have returned."""


class PlainLM:
    """A LLaDA or Dream forward over a mosaic Model's weights with the published K/V cache."""

    def __init__(self, model):
        self.m, self.cfg = model, model.cfg
        self.calls = 0

    def __call__(self, ids, past=None, replace=None, valid=None, q_pos=None):
        """ids [B, n] -> (logits [B, n, V], present per layer (K, V) [B, Hkv, Lk, hd] pre-RoPE).

        past: per-layer (K, V) of the published cache; replace: [L] bool, the dual cache's rows
        the input overwrites in place; valid: [B, Lk] bool key mask (LLaDA padding); q_pos:
        [B, n] query positions (Dream padding; default: the last n keys, or the replaced rows)."""
        self.calls += 1
        if self.calls > SPIN_LIMIT:
            raise Spin("the published loop would spin")
        cfg, m = self.cfg, self.m
        B, n = ids.shape
        H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = m.embed[ids]
        present = []
        for i, lw in enumerate(m.layers):
            h = rms(x, lw["attn_norm"], cfg.rms_eps)
            lin = lambda t, w, b=None: t @ w.T + (b if b is not None else 0)  # noqa: E731
            q = lin(h, lw["q"], lw.get("q_bias")).view(B, n, H, hd).transpose(1, 2)
            k = lin(h, lw["k"], lw.get("k_bias")).view(B, n, Hkv, hd).transpose(1, 2)
            v = lin(h, lw["v"], lw.get("v_bias")).view(B, n, Hkv, hd).transpose(1, 2)
            end = None
            if past is not None:
                pk, pv = past[i]
                if replace is None:
                    k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
                else:
                    idx = replace.nonzero().squeeze(1)
                    pk[:, :, idx] = k
                    pv[:, :, idx] = v
                    k, v = pk, pv
                    end = int(idx.max()) + 1
            present.append((k, v))
            Lk = k.shape[2]
            kpos = torch.arange(Lk).expand(B, Lk)
            if q_pos is None:
                top = Lk if end is None else end
                qp = torch.arange(top - n, top).expand(B, n)
            else:
                qp = q_pos
            qr = rope(q, qp, cfg.rot_dim, cfg.rope_theta, cfg.rope_fp32)
            kr = rope(k, kpos, cfg.rot_dim, cfg.rope_theta, cfg.rope_fp32)
            mask = None if valid is None else valid[:, None, :].expand(B, 1, Lk)
            o = attend(qr, kr, v, mask).transpose(1, 2).reshape(B, n, H * hd)
            x = x + o @ lw["o"].T
            h = rms(x, lw["ffn_norm"], cfg.rms_eps)
            x = x + (F.silu(h @ lw["gate"].T) * (h @ lw["up"].T)) @ lw["down"].T
        return rms(x, m.final_norm, cfg.rms_eps) @ m.lm_head.T, present


# -- LLaDA: llada/generate.py

def gumbel(logits, temperature, g):
    if temperature == 0:
        return logits
    l64 = logits.to(torch.float64)
    u = torch.rand(l64.shape, dtype=torch.float64, generator=g)
    return l64.exp() / (-torch.log(u)) ** temperature


def schedule(block_mask, steps):
    total = block_mask.sum(1, keepdim=True)
    out = torch.zeros(total.shape[0], steps, dtype=torch.int64) + total // steps
    for j in range(total.shape[0]):
        out[j, : int(total[j] % steps)] += 1
    return out


def _candidates(logits, temperature, remasking, mask, x, g):
    x0 = torch.argmax(gumbel(logits, temperature, g), dim=-1)
    if remasking == "low_confidence":
        p = F.softmax(logits.to(torch.float64), dim=-1)
        x0_p = torch.gather(p, -1, x0[..., None]).squeeze(-1)
    else:
        x0_p = torch.rand(x0.shape, generator=g)
    return torch.where(mask, x0, x), torch.where(mask, x0_p, -torch.inf)


def transfer_index(logits, temperature, remasking, mask, x, k, threshold, g):
    x0, conf = _candidates(logits, temperature, remasking, mask, x, g)
    out = torch.zeros_like(x0, dtype=torch.bool)
    if threshold is not None:
        k = mask.sum(1)
    for j in range(conf.shape[0]):
        vals, sel = torch.topk(conf[j], k=int(k[j]))
        out[j, sel] = True
        if threshold is not None:
            for r in range(1, int(k[j])):
                if vals[r] < threshold:
                    out[j, sel[r]] = False
    return x0, out


def transfer_index_dynamic(logits, temperature, remasking, mask, x, factor, g):
    x0, conf = _candidates(logits, temperature, remasking, mask, x, g)
    out = torch.zeros_like(x0, dtype=torch.bool)
    counts = mask.sum(1)
    for j in range(conf.shape[0]):
        n = int(counts[j])
        limits = [1 - factor / (r + 1) for r in range(1, n + 1)]
        limits[0] = -1                               # raises IndexError at n = 0, as published
        ranked = torch.sort(conf[j][mask[j]], descending=True)[0]
        for top in range(n):
            if ranked[top] < limits[top]:
                break
        if top == 0 or top == n - 1:
            top += 1
        _, sel = torch.topk(conf[j], k=top)
        out[j, sel] = True
    return x0, out


def _select(logits, temperature, remasking, mask, x, k, threshold, factor, g):
    if factor is None:
        return transfer_index(logits, temperature, remasking, mask, x, k, threshold, g)
    return transfer_index_dynamic(logits, temperature, remasking, mask, x, factor, g)


def llada_generate(lm, prompt, steps, gen_length, block_length, temperature=0.0, remasking="low_confidence",
                   threshold=None, factor=None, cache="none", g=None, valid=None):
    """generate / generate_with_prefix_cache / generate_with_dual_cache -> (x, nfe).
    valid: [B, P + gen_length] key mask of a left-padded batch (Mosaic's extension)."""
    mask_id = lm.cfg.mask_id
    B, P = prompt.shape
    x = torch.full((B, P + gen_length), mask_id, dtype=torch.long)
    x[:, :P] = prompt
    assert gen_length % block_length == 0
    blocks = gen_length // block_length
    assert steps % blocks == 0
    spb = steps // blocks
    nfe = 0
    for nb in range(blocks):
        s, e = P + nb * block_length, P + (nb + 1) * block_length
        counts = schedule(x[:, s:e] == mask_id, spb)
        counted = threshold is None and factor is None     # the schedule: the only rule reading counts
        if cache == "none":
            i = 0
            while True:
                nfe += 1
                mask = x == mask_id
                logits, _ = lm(x, valid=valid)
                mask[:, e:] = False
                x0, t = _select(logits, temperature, remasking, mask, x, counts[:, i] if counted else None,
                                threshold, factor, g)
                x[t] = x0[t]
                i += 1
                if not (x[:, s:e] == mask_id).any():
                    break
            continue
        logits, past = lm(x, valid=valid)
        mask = x == mask_id
        mask[:, e:] = False
        x0, t = _select(logits, temperature, remasking, mask, x, counts[:, 0], threshold, factor, g)
        x[t] = x0[t]
        nfe += 1
        if cache == "prefix":
            past = [(k[:, :, :s], v[:, :, :s]) for k, v in past]
        replace = torch.zeros(x.shape[1], dtype=torch.bool)
        replace[s:e] = True
        i = 1
        while (x[:, s:e] == mask_id).any():
            nfe += 1
            if cache == "prefix":
                mask = x[:, s:] == mask_id
                mask[:, block_length:] = False
                logits, _ = lm(x[:, s:], past=past, valid=valid)
                gumbel(logits, temperature, g)                    # drawn and unused, as published
                x0, t = _select(logits, temperature, remasking, mask, x[:, s:], counts[:, i] if counted else None,
                                threshold, factor, g)
                x[:, s:][t] = x0[t]
            else:
                mask = x[:, s:e] == mask_id
                logits, _ = lm(x[:, s:e], past=past, replace=replace, valid=valid)
                x0, t = _select(logits, temperature, remasking, mask, x[:, s:e], counts[:, i] if counted else None,
                                threshold, factor, g)
                x[:, s:e][t] = x0[t]
            i += 1
    return x, nfe


# -- Dream: generation_utils_block.py and generation_utils.py

def sample_tokens(logits, temperature=0.0, top_p=None, top_k=None, neg_entropy=False, g=None):
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        srt, order = torch.sort(logits, descending=True)
        cut = torch.cumsum(F.softmax(srt, dim=-1), dim=-1) > top_p
        cut[..., 1:] = cut[..., :-1].clone()
        cut[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(cut).scatter_(-1, order, cut), torch.finfo(logits.dtype).min)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]))[0][..., -1, None]
        logits = logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        p = torch.distributions.Categorical(probs=probs).probs
        x0 = torch.multinomial(p.reshape(-1, p.shape[-1]), 1, True, generator=g).T.reshape(p.shape[:-1])
        conf = torch.gather(probs, -1, x0[..., None]).squeeze(-1)
    else:
        conf, x0 = probs.max(dim=-1)
    if neg_entropy:
        conf = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return conf, x0


def _shift(logits):
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


def dream_block_generate(lm, prompt, gen_length, steps, block_length, threshold=None, dual=False, temperature=0.0,  # noqa: C901
                         top_p=None, top_k=None, alg_temp=None, eps=1e-3, g=None):
    """generation_utils_block.py _sample (batch 1): threshold set = alg 'confidence_threshold',
    None = the entropy schedule. Returns (x, forwards)."""
    mask_id = lm.cfg.mask_id
    P = prompt.shape[1]
    x = F.pad(prompt, (0, gen_length), value=mask_id)
    blocks = gen_length // block_length
    spb = steps // blocks
    ts = torch.linspace(1, eps, spb + 1)
    lm.calls = 0
    for nb in range(blocks):
        s, e = P + nb * block_length, P + (nb + 1) * block_length
        logits, past = lm(x)
        _, x0 = sample_tokens(_shift(logits), temperature, top_p, top_k, g=g)
        x[:, s] = x0[:, s]
        kv = [(k.transpose(1, 2).reshape(1, -1, k.shape[1] * k.shape[3]),
               v.transpose(1, 2).reshape(1, -1, v.shape[1] * v.shape[3])) for k, v in past]   # [B, L, kv_dim]
        if not dual:
            kv = [(k[:, :s], v[:, :s]) for k, v in kv]
        replace = torch.zeros(x.shape[1], dtype=torch.bool)
        replace[s:e] = True
        i = 1
        while True:
            run = x[:, s:e] if dual else x[:, s:]
            mask = run == mask_id
            past = [(k.view(1, -1, lm.cfg.num_kv_heads, lm.cfg.head_dim).transpose(1, 2),
                     v.view(1, -1, lm.cfg.num_kv_heads, lm.cfg.head_dim).transpose(1, 2)) for k, v in kv]
            logits, present = lm(run, past=past, replace=replace if dual else None)
            if dual:   # the published cache is overwritten in place
                kv = [(k.transpose(1, 2).reshape(1, -1, k.shape[1] * k.shape[3]),
                       v.transpose(1, 2).reshape(1, -1, v.shape[1] * v.shape[3])) for k, v in present]
            logits = _shift(logits)
            if threshold is not None:
                conf, x0 = sample_tokens(logits[mask], temperature, top_p, top_k, g=g)
                xs = torch.full_like(run, mask_id)
                full = torch.full(run.shape, -torch.inf, dtype=logits.dtype)
                xs[mask] = x0
                full[mask] = conf
                full[:, block_length:] = -torch.inf
                k = int((x[:, s:e] == mask_id).sum())
                vals, sel = torch.topk(full, k)
                t = torch.zeros_like(xs, dtype=torch.bool)
                t[0, sel[0]] = True
                for r in range(1, k):
                    if vals[0, r] < threshold:
                        t[0, sel[0, r]] = False
                run[t] = xs[t]
            else:
                if i == spb:
                    break
                mask[:, block_length:] = False
                conf, x0 = sample_tokens(logits[mask], temperature, top_p, top_k, neg_entropy=True, g=g)
                m = mask.sum() / mask.shape[0]
                n = int(m * (1 - ts[i + 1] / ts[i])) if i < spb - 1 else int(m)
                full = torch.full(run.shape, -torch.inf, dtype=logits.dtype)
                full[mask] = conf
                full[:, block_length:] = -torch.inf
                if n > 0:
                    if not alg_temp:
                        _, sel = torch.topk(full, n)
                    else:
                        sel = torch.multinomial(F.softmax(full / alg_temp, dim=-1), num_samples=n, generator=g)
                    xs = torch.full_like(run, mask_id)
                    xs[mask] = x0
                    rows = torch.arange(x.shape[0]).unsqueeze(1).expand_as(sel)
                    run[rows, sel] = xs[rows, sel]
                i += 1
            if not (x[:, s:e] == mask_id).any():
                break
    return x, lm.calls


def dream_threshold_generate(lm, prompt, gen_length, steps, threshold, temperature=0.0, top_p=None, top_k=None,
                             g=None):
    """generation_utils.py _sample with alg 'confidence_threshold' (batch 1). -> (x, forwards)."""
    mask_id = lm.cfg.mask_id
    x = F.pad(prompt, (0, gen_length), value=mask_id)
    masked = int((x == mask_id).sum())
    assert masked % steps == 0 and x.shape[0] == 1
    quota, left, i = masked // steps, 0, 0
    lm.calls = 0
    while i < steps:
        mask = x == mask_id
        logits, _ = lm(x)
        conf, x0 = sample_tokens(_shift(logits)[mask], temperature, top_p, top_k, g=g)
        xs = torch.full_like(x, mask_id)
        xs[mask] = x0
        full = torch.full(x.shape, -torch.inf, dtype=logits.dtype)
        full[mask] = conf
        k = quota + left
        left = 0
        vals, sel = torch.topk(full, k)
        t = torch.zeros_like(x, dtype=torch.bool)
        t[0, sel[0]] = True
        for r in range(1, k):
            if vals[0, r] < threshold:
                if i < steps - 1:
                    left += 1
                else:
                    quota = 0
                    steps += 1
                    left += 1
                t[0, sel[0, r]] = False
        x[t] = xs[t]
        i += 1
    return x, lm.calls
