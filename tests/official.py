"""Plain re-implementations of the official sampling functions, as the oracle of mosaic.compat.

Written from the published behaviour (GSAI-ML/LLaDA generate.py; Dream-org/Dream-v0
generation_utils.py: DreamGenerationMixin.diffusion_generate and _sample), sharing no code with
mosaic. `model(ids, attention_mask)` stands for the network: logits [B, L, V] for ids [B, L] with
a [B, L] mask (1 = token) or None. Every random draw uses torch's default generator, as there."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _transfer_counts(block_masks: torch.Tensor, steps: int) -> torch.Tensor:
    total = block_masks.sum(dim=1, keepdim=True)
    counts = (total // steps).repeat(1, steps)
    extra = total % steps
    for b in range(total.shape[0]):
        counts[b, : int(extra[b])] += 1
    return counts


@torch.no_grad()
def llada_generate(model, prompt, attention_mask=None, steps=128, gen_length=128, block_length=128,
                   temperature=0., cfg_scale=0., remasking="low_confidence", mask_id=126336,
                   logits_eos_inf=False, confidence_eos_eot_inf=False, eos_id=126081, eot_id=126348):
    B, P = prompt.shape
    x = torch.full((B, P + gen_length), mask_id, dtype=torch.long)
    x[:, :P] = prompt
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, torch.ones(B, gen_length, dtype=attention_mask.dtype)], 1)
    is_prompt = x != mask_id
    assert gen_length % block_length == 0
    blocks = gen_length // block_length
    assert steps % blocks == 0
    per_block = steps // blocks
    for nb in range(blocks):
        lo, hi = P + nb * block_length, P + (nb + 1) * block_length
        counts = _transfer_counts(x[:, lo:hi] == mask_id, per_block)
        for i in range(per_block):
            masked = x == mask_id
            if cfg_scale > 0:
                uncond = x.clone()
                uncond[is_prompt] = mask_id
                am = None if attention_mask is None else torch.cat([attention_mask, attention_mask])
                both = model(torch.cat([x, uncond]), am)
                cond, un = both[:B], both[B:]
                logits = un + (cfg_scale + 1) * (cond - un)
            else:
                logits = model(x, attention_mask)
            if logits_eos_inf:
                logits[:, :, eos_id] = -torch.inf
            if temperature == 0:
                noisy = logits
            else:
                lg = logits.to(torch.float64)
                u = torch.rand_like(lg, dtype=torch.float64)
                noisy = lg.exp() / (-torch.log(u)) ** temperature
            x0 = noisy.argmax(dim=-1)
            if confidence_eos_eot_inf:
                noisy[:, :, eos_id] = -torch.inf
                logits[:, :, eot_id] = -torch.inf
            if remasking == "low_confidence":
                p = F.softmax(logits, dim=-1)
                conf = torch.gather(p, -1, x0[..., None])[..., 0]
            else:
                conf = torch.rand(x0.shape)
            conf[:, hi:] = -torch.inf
            x0 = torch.where(masked, x0, x)
            conf = torch.where(masked, conf, torch.tensor(-torch.inf, dtype=conf.dtype))
            take = torch.zeros_like(x, dtype=torch.bool)
            for b in range(B):
                take[b, torch.topk(conf[b], int(counts[b, i])).indices] = True
            x[take] = x0[take]
    return x


def _top_p(logits, top_p):
    srt, order = torch.sort(logits, descending=True)
    cum = torch.cumsum(F.softmax(srt, dim=-1), dim=-1)
    drop = cum > top_p
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, drop)
    return logits.masked_fill(mask, torch.finfo(logits.dtype).min)


def _top_k(logits, top_k):
    kth = torch.topk(logits, min(top_k, logits.shape[-1]))[0][..., -1, None]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def _sample(logits, temperature=0.0, top_p=None, top_k=None, margin=False, entropy=False):
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = _top_p(logits, top_p)
    if top_k is not None:
        logits = _top_k(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        try:
            x0 = torch.distributions.Categorical(probs=probs).sample()
            conf = torch.gather(probs, -1, x0[..., None])[..., 0]
        except Exception:
            conf, x0 = probs.max(dim=-1)
    else:
        conf, x0 = probs.max(dim=-1)
    if margin:
        top2 = torch.sort(probs, dim=-1, descending=True)[0]
        conf = top2[:, 0] - top2[:, 1]
    if entropy:
        conf = (probs * torch.log(probs + 1e-10)).sum(dim=-1)
    return conf, x0


@torch.no_grad()
def dream_generate(model, inputs, attention_mask=None, mask_token_id=None, max_position_embeddings=None,
                   return_history=False, **kw):
    """diffusion_generate with no generation_config: DreamGenerationConfig.from_model_config of a
    model config without generation fields of its own, under transformers 4.46.2 (Dream's pinned
    version), whose PretrainedConfig holds max_length 20, temperature 1.0, top_k 50, top_p 1.0;
    then kw."""
    opt = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "max_length": 20, "max_new_tokens": None,
           "eps": 1e-3, "steps": 512, "alg": "origin", "alg_temp": None}
    opt.update(kw)
    P = inputs.shape[1]
    if opt["max_new_tokens"] is not None:
        max_length = opt["max_new_tokens"] + P
    elif "max_length" not in kw and opt["max_length"] == 20:
        max_length = 20 + P
        if max_position_embeddings is not None:
            max_length = min(max_length, max_position_embeddings)
    else:
        max_length = opt["max_length"]
    assert P < max_length
    x = F.pad(inputs, (0, max_length - P), value=mask_token_id)
    mask = None
    if attention_mask is not None and bool((attention_mask == 0).any()):
        mask = F.pad(attention_mask, (0, max_length - P), value=1)
    steps, eps, alg = opt["steps"], opt["eps"], opt["alg"]
    ts = torch.linspace(1, eps, steps + 1)
    history = []
    for i in range(steps):
        masked = x == mask_token_id
        logits = model(x, mask)
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        mlog = logits[masked]
        t, s = ts[i], ts[i + 1]
        sample = dict(temperature=opt["temperature"], top_p=opt["top_p"], top_k=opt["top_k"])
        if alg == "origin":
            p = 1 - s / t if i < steps - 1 else 1
            x0 = torch.full((int(masked.sum()),), mask_token_id, dtype=torch.long)
            chosen = torch.rand(x0.shape) < p
            _, x0[chosen] = _sample(mlog[chosen], **sample)
            x[masked] = x0.clone()
        else:
            conf, x0 = _sample(mlog, margin=alg == "topk_margin", entropy=alg == "entropy", **sample)
            n_masked = masked.sum() / masked.shape[0]
            k = int(n_masked * (1 - s / t)) if i < steps - 1 else int(n_masked)
            full = torch.full_like(x, -torch.inf, dtype=logits.dtype)
            full[masked] = conf
            if k > 0:
                if not opt["alg_temp"]:
                    _, idx = torch.topk(full, k)
                else:
                    idx = torch.multinomial(F.softmax(full / opt["alg_temp"], dim=-1), num_samples=k)
                cand = torch.full_like(x, mask_token_id)
                cand[masked] = x0.clone()
                rows = torch.arange(x.shape[0])[:, None].expand_as(idx)
                x[rows, idx] = cand[rows, idx]
        history.append(x.clone())
    return (x, history) if return_history else x
