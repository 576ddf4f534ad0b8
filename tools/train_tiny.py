"""Train the bundled tiny masked-diffusion models on mosaic/assets/tasks.py, then score them.

    python tools/train_tiny.py --arch both --device cuda --out /tmp/tiny --pack $OUT   # ~90 s a model
    python tools/train_tiny.py --arch llada --device cpu --steps 40 --batch 32 --out /tmp/t  # smoke test

Each model is written to OUT/tiny-<arch>/ (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json, training.json), loaded back through mosaic.loader,
checked against the engine's own forward, and scored on tasks.held_out() with the engine's sampler
(planned path, the bundled generation_config: 8 new tokens in 8 steps): the record goes to
REPORT/tiny_accuracy_tiny-<arch>.json (REPORT: --pack, else OUT). --pack also writes
REPORT/tiny-<arch>.tar of each folder, so that few files carry everything.

Recipe (the task and its format are tasks.py's, unchanged):
  * data is drawn on the device, vectorised, with the distribution of tasks.sample, minus the
    held-out prompts; shapes of one batch are mixed, prompts left-padded to one length and the
    pads masked as attention keys (RoPE is relative, so this equals an unpadded forward);
  * curriculum: addition (the hard task) gets --add-share of the rows, 3-digit operands
    --add3-share of those, and a growing share (0 -> --hard over the first 20% of training) of
    additions have carry chains forced digit by digit (a_i + b_i = 9 propagates, >= 10 generates);
  * LLaDA's SFT masking: t ~ U(0, 1), each answer token (digits and end-of-text padding) masked
    with probability t, at least one. Drawn as "k ~ U{1..8} masked, at random positions", the same
    law. The loss is the cross entropy on masked tokens weighted 1/t with t = k/8, the realised
    ratio, so every row counts the same (weighting by the sampled t, as this script did before,
    gave rows with t near 0 and one forced mask weights up to 1000);
  * AdamW, warm-up then cosine decay over max(step / --steps, seconds / --time-budget): the run
    stops at whichever comes first and the schedule always completes; bf16 autocast on CUDA.

The model here is a compact autograd implementation used only for training (q/k/v and gate/up
fused into one matrix each); it is saved in the published key layout (LLaDA: model.transformer.*,
Dream: Qwen2 names) in bfloat16, and its logits are compared with the engine's before scoring.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tarfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from mosaic.assets import tasks

ANS = tasks.ANSWER_LEN
SHAPES = tasks.shapes()                          # [("add", 2), ("add", 3), ("sort", 3..8)]
MAX_SORT = max(s for k, s in SHAPES if k == "sort")
MAX_ADD = max(s for k, s in SHAPES if k == "add")
PROMPT = 1 + max(len("sort ") + MAX_SORT + 1, 2 * MAX_ADD + 2)   # BOS + longest prompt: 15 tokens
GEOMETRY = {"d": 192, "layers": 6, "heads": 6, "ffn": 448}       # llada 4.9 MB, dream 4.3 MB in bf16


# -- the model ------------------------------------------------------------------------------------

class Tiny(torch.nn.Module):
    def __init__(self, vocab: int, arch: str, d: int, layers: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        assert d % heads == 0 and heads % kv_heads == 0
        self.arch, self.d, self.heads, self.kv_heads, self.ffn = arch, d, heads, kv_heads, ffn
        self.hd = hd = d // heads
        self.emb = torch.nn.Embedding(vocab, d)
        bias = arch == "dream"
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            b = torch.nn.Module()
            b.n1 = torch.nn.Parameter(torch.ones(d))
            b.qkv = torch.nn.Linear(d, (heads + 2 * kv_heads) * hd, bias=bias)
            b.o = torch.nn.Linear(heads * hd, d, bias=False)
            b.n2 = torch.nn.Parameter(torch.ones(d))
            b.gate_up = torch.nn.Linear(d, 2 * ffn, bias=False)
            b.down = torch.nn.Linear(ffn, d, bias=False)
            self.blocks.append(b)
        self.nf = torch.nn.Parameter(torch.ones(d))
        self.head = torch.nn.Linear(d, vocab, bias=False)
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    @staticmethod
    def norm(x, w, eps=1e-5):
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def forward(self, ids, valid=None, rows: slice | None = None):
        """Logits [B, L, V] (or [B, rows, V]); valid [B, L] marks the non-pad keys. Dream's
        position j is predicted from hidden state j-1 (position 0 from itself)."""
        B, L = ids.shape
        H, KV, hd = self.heads, self.kv_heads, self.hd
        f = torch.arange(L, device=ids.device, dtype=torch.float32)[:, None] * self.inv_freq[None]
        cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]  # [L, 1, hd]
        mask = None if valid is None else valid[:, None, None, :]
        x = self.emb(ids)
        for b in self.blocks:
            qkv = b.qkv(self.norm(x, b.n1)).view(B, L, H + 2 * KV, hd)
            qk, v = qkv[:, :, :H + KV], qkv[:, :, H + KV:]
            qk = qk * cos + torch.cat([-qk[..., hd // 2:], qk[..., :hd // 2]], -1) * sin
            qk = qk.to(v.dtype).transpose(1, 2)
            q, k, v = qk[:, :H], qk[:, H:], v.transpose(1, 2)
            if KV != H:
                k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + b.o(o.transpose(1, 2).reshape(B, L, H * hd))
            g, u = b.gate_up(self.norm(x, b.n2)).chunk(2, -1)
            x = x + b.down(F.silu(g) * u)
        if rows is not None and self.arch == "dream" and rows.start:   # slots read hidden rows j-1
            x = x[:, rows.start - 1:rows.stop - 1]
        else:
            if self.arch == "dream":
                x = torch.cat([x[:, :1], x[:, :-1]], 1)
            if rows is not None:
                x = x[:, rows]
        return self.head(self.norm(x, self.nf))

    def state_dict_published(self) -> dict[str, torch.Tensor]:
        H, KV, hd, F_ = self.heads, self.kv_heads, self.hd, self.ffn
        out = {}
        for i, b in enumerate(self.blocks):
            q, k, v = b.qkv.weight.split([H * hd, KV * hd, KV * hd])
            gate, up = b.gate_up.weight.split([F_, F_])
            if self.arch == "llada":
                p = f"model.transformer.blocks.{i}."
                out |= {p + "attn_norm.weight": b.n1, p + "q_proj.weight": q, p + "k_proj.weight": k,
                        p + "v_proj.weight": v, p + "attn_out.weight": b.o.weight, p + "ff_norm.weight": b.n2,
                        p + "ff_proj.weight": gate, p + "up_proj.weight": up, p + "ff_out.weight": b.down.weight}
            else:
                p = f"model.layers.{i}."
                a = p + "self_attn."
                qb, kb, vb = b.qkv.bias.split([H * hd, KV * hd, KV * hd])
                out |= {p + "input_layernorm.weight": b.n1, p + "post_attention_layernorm.weight": b.n2,
                        a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v,
                        a + "q_proj.bias": qb, a + "k_proj.bias": kb, a + "v_proj.bias": vb,
                        a + "o_proj.weight": b.o.weight, p + "mlp.gate_proj.weight": gate,
                        p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": b.down.weight}
        if self.arch == "llada":
            p = "model.transformer."
            out |= {p + "wte.weight": self.emb.weight, p + "ln_f.weight": self.nf,
                    p + "ff_out.weight": self.head.weight}
        else:
            out |= {"model.embed_tokens.weight": self.emb.weight, "model.norm.weight": self.nf,
                    "lm_head.weight": self.head.weight}
        return {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in out.items()}


# -- data: tasks.sample's distribution, vectorised on the device -----------------------------------

def prompt_key(prompt: str) -> int:
    """An integer per prompt text (the Sampler computes the same from its tensors)."""
    body = prompt.rstrip("=")
    if body.startswith("sort "):
        digits = body[5:]
        return 10**9 + len(digits) * 10**8 + int(digits)
    a, b = body.split("+")
    return int(a) * 1000 + int(b)


def ndigits(x):
    return 1 + (x >= 10).long() + (x >= 100).long() + (x >= 1000).long()


class Sampler:
    """Rows [N, PROMPT + ANS]: left-padded prompt (BOS first) and the answer padded with EOS."""

    def __init__(self, vocab, device, seed, add_share, add3_share, exclude):
        self.dev = torch.device(device)
        self.gen = torch.Generator(device=self.dev).manual_seed(seed)
        self.digit = torch.tensor([vocab[str(i)] for i in range(10)], device=self.dev)
        self.ids = {c: vocab[c] for c in "+= sort"} | {k: vocab[f"<|{k}|>"] for k in ("bos", "eos")}
        sort_sizes = [s for k, s in SHAPES if k == "sort"]
        w = [add_share * (1 - add3_share) if (k, s) == ("add", 2) else add_share * add3_share if k == "add"
             else (1 - add_share) / len(sort_sizes) for k, s in SHAPES]
        self.weights = torch.tensor(w, dtype=torch.float64, device=self.dev)
        self.is_add = torch.tensor([k == "add" for k, _ in SHAPES], device=self.dev)
        self.sizes = torch.tensor([s for _, s in SHAPES], device=self.dev)
        self.exclude = torch.tensor(sorted({prompt_key(p) for p in exclude}), device=self.dev)

    def rand(self, *shape):
        return torch.rand(*shape, generator=self.gen, device=self.dev, dtype=torch.float64)

    def uniform_int(self, lo, hi):   # inclusive, elementwise bounds
        return lo + (self.rand(*lo.shape) * (hi - lo + 1)).long().clamp_max(hi - lo)

    def addition(self, size, hard):
        """tasks.sample('add', size) for each row; `hard` rows get carry chains forced."""
        p10 = torch.tensor([1, 10, 100, 1000], device=self.dev)
        a = self.uniform_int(p10[size - 1], p10[size] - 1)
        b = self.uniform_int(torch.full_like(a, 10), p10[size] - 1)
        # hard rows: each digit of b that exists is left as drawn, made to propagate a carry
        # (a_i + b_i = 9), or to generate one (a_i + b_i >= 10), each with probability 1/3
        nb = ndigits(b)
        new = torch.zeros_like(b)
        for i in range(MAX_ADD):
            ai, bi = a // p10[i] % 10, b // p10[i] % 10
            choice = (self.rand(*a.shape) * 3).long()
            gen_digit = 10 - ai + (self.rand(*a.shape) * ai).long().clamp_max((ai - 1).clamp_min(0))
            di = torch.where(choice == 1, 9 - ai, torch.where((choice == 2) & (ai > 0), gen_digit, bi))
            new += torch.where(hard & (i < nb), di, bi) * p10[i]
        ok = (new >= 10) & (new <= p10[size] - 1)
        b = torch.where(ok, new, b)
        swap = self.rand(*a.shape) < 0.5
        return torch.where(swap, b, a), torch.where(swap, a, b)

    def rows(self, n: int, hard_share: float):
        dev, ids = self.dev, self.ids
        shape = torch.multinomial(self.weights, n, replacement=True, generator=self.gen)
        is_add, size = self.is_add[shape], self.sizes[shape]
        hard = is_add & (self.rand(n) < hard_share)
        first, second = self.addition(torch.where(is_add, size, 2), hard)
        nf, ns = ndigits(first), ndigits(second)
        sd = (self.rand(n, MAX_SORT) * 10).long().clamp_max(9)                     # sort digits
        pos = torch.arange(MAX_SORT, device=dev)
        # prompt, right-aligned: r = distance from its last token ('=')
        r = torch.arange(PROMPT - 1, -1, -1, device=dev)[None].expand(n, PROMPT)
        pad = torch.full((n, PROMPT), ids["eos"], device=dev)
        p10 = torch.tensor([1, 10, 100, 1000], device=dev)

        def digit_of(x, power):
            return self.digit[(x[:, None] // p10[power.clamp(0, 3)]) % 10]

        nS, nF = ns[:, None], nf[:, None]
        add = torch.where(r == 0, ids["="], pad)
        add = torch.where((r >= 1) & (r <= nS), digit_of(second, r - 1), add)
        add = torch.where(r == nS + 1, ids["+"], add)
        add = torch.where((r >= nS + 2) & (r <= nS + nF + 1), digit_of(first, r - nS - 2), add)
        add = torch.where(r == nS + nF + 2, ids["bos"], add)
        add_len = (ns + nf + 3)                                                     # with BOS
        n_s = size[:, None]
        srt = torch.where(r == 0, ids["="], pad)
        srt = torch.where((r >= 1) & (r <= n_s), self.digit[sd.gather(1, (n_s - r).clamp(0, MAX_SORT - 1))], srt)
        for j, c in enumerate(" tros"):                  # "sort " read backwards from the digits
            srt = torch.where(r == n_s + 1 + j, ids[c], srt)
        srt = torch.where(r == n_s + 6, ids["bos"], srt)
        prompt = torch.where(is_add[:, None], add, srt)
        plen = torch.where(is_add, add_len, size + 7)
        # answers, left-aligned, EOS after
        total = first + second
        nt = ndigits(total)[:, None]
        i = torch.arange(ANS, device=dev)[None]
        ans_add = torch.where(i < nt, digit_of(total, (nt - 1 - i)), ids["eos"])
        sorted_d = torch.where(pos[None] < size[:, None], sd, 10).sort(1).values
        sorted_d = torch.cat([sorted_d, torch.full((n, ANS - MAX_SORT), 10, device=dev)], 1) \
            if ANS > MAX_SORT else sorted_d[:, :ANS]
        ans_sort = torch.where(sorted_d < 10, self.digit[sorted_d.clamp_max(9)], ids["eos"])
        answer = torch.where(is_add[:, None], ans_add, ans_sort)
        # held-out prompts are never trained on
        num = (sd * 10 ** (MAX_SORT - 1 - pos)).sum(1) // 10 ** (MAX_SORT - size)
        key = torch.where(is_add, first * 1000 + second, 10**9 + size * 10**8 + num)
        keep = ~torch.isin(key, self.exclude)
        valid = r < plen[:, None]
        valid = torch.cat([valid, torch.ones(n, ANS, dtype=torch.bool, device=dev)], 1)
        return torch.cat([prompt, answer], 1), valid, keep, is_add


def decode_rows(vocab, ids, valid) -> list[tuple[str, str]]:
    """(prompt, answer) texts of sampler rows, for checks."""
    inv = {i: t for t, i in vocab.items()}
    out = []
    for row, ok in zip(ids.tolist(), valid.tolist()):
        p = "".join(inv[t] for t, v in zip(row[:PROMPT], ok[:PROMPT]) if v and inv[t] != "<|bos|>")
        a = "".join(inv[t] for t in row[PROMPT:] if inv[t] != "<|eos|>")
        out.append((p, a))
    return out


# -- checkpoint folder -----------------------------------------------------------------------------

def build_tokenizer(vocab: dict[str, int]) -> Tokenizer:
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|eos|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(tasks.SPECIALS))
    return tok


def save(model: Tiny, vocab: dict[str, int], out: Path, meta: dict):
    out.mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict_published(), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    ids = {k: vocab[f"<|{k}|>"] for k in ("bos", "eos", "mask", "eot")}
    D, layers, H, F_ = model.d, len(model.blocks), model.heads, model.ffn
    if model.arch == "llada":
        cfg = {"model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": D,
               "n_layers": layers, "n_heads": H, "n_kv_heads": model.kv_heads, "mlp_hidden_size": F_,
               "vocab_size": len(vocab), "embedding_size": len(vocab),
               "rope_theta": 10000.0, "rope_full_precision": True, "rms_norm_eps": 1e-5,
               "max_sequence_length": 64, "include_bias": False, "weight_tying": False,
               "activation_type": "silu", "block_type": "llama",
               "mask_token_id": ids["mask"], "eos_token_id": ids["eos"], "pad_token_id": ids["eos"],
               "bos_token_id": ids["bos"], "eot_token_id": ids["eot"]}
    else:
        cfg = {"model_type": "Dream", "architectures": ["DreamModel"], "hidden_size": D,
               "num_hidden_layers": layers, "num_attention_heads": H,
               "num_key_value_heads": model.kv_heads, "intermediate_size": F_,
               "vocab_size": len(vocab), "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
               "max_position_embeddings": 64, "tie_word_embeddings": False,
               "mask_token_id": ids["mask"], "pad_token_id": ids["eos"],
               "eos_token_id": ids["eos"], "bos_token_id": ids["bos"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"max_new_tokens": ANS, "steps": ANS}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    build_tokenizer(vocab).save(str(out / "tokenizer.json"))
    tok_cfg = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "mask_token": "<|mask|>",
               "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
               "add_bos_token": True}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


# -- checks and scoring through the engine ---------------------------------------------------------

def engine_logits_gap(model: Tiny, folder: Path, device) -> float:
    """Max |logit difference| between this model (weights rounded to bf16, fp32 math) and the
    engine's native forward on the saved folder (fp32), over an unpadded and a padded batch."""
    from mosaic.loader import load
    from mosaic.runtime.runner import NativeRunner
    ref = copy.deepcopy(model).float()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    eng = load(folder, device=device, dtype="float32")
    tok = eng.tokenizer
    mask_id = eng.cfg.mask_id
    gap = 0.0
    for batch in (["57+384=", "999+1="], ["sort 31415926=", "12+30="]):
        enc = [tok.encode(p) for p in batch]
        P = max(map(len, enc))
        x = torch.full((len(enc), P + ANS), mask_id, dtype=torch.long)
        valid = torch.ones_like(x, dtype=torch.bool)
        for i, e in enumerate(enc):
            x[i, :P - len(e)] = eng.cfg.pad_id
            valid[i, :P - len(e)] = False
            x[i, P - len(e):P] = torch.tensor(e)
        x, valid = x.to(device), valid.to(device)
        with torch.no_grad():
            theirs = NativeRunner(eng).forward(x, None if bool(valid.all()) else valid).float()
            if eng.cfg.logit_shift:  # Dream's sampler shifts the logits; the training model did already
                theirs = torch.cat([theirs[:, :1], theirs[:, :-1]], 1)
            ours = ref(x, valid)
        gap = max(gap, (theirs - ours)[:, P:].abs().max().item())   # the answer slots
    return gap


def evaluate(folder: Path, device: str, dtype: str = "float32", per_shape: int = 100) -> dict:
    """Exact answers on tasks.held_out() through MosaicEngine.generate (planned path, the
    folder's generation_config: 8 tokens in 8 steps), one batch per prompt length."""
    from mosaic import MosaicEngine
    engine = MosaicEngine(str(folder), {"device": device, "dtype": dtype, "progress": False})
    prompts = tasks.held_out(per_shape)
    by_len = defaultdict(list)
    for p in prompts:
        by_len[len(p)].append(p)
    right, total, wrong = defaultdict(int), defaultdict(int), []
    t0 = time.perf_counter()
    for group in by_len.values():
        out = engine.generate(group)
        for p, t in zip(group, out.texts):
            kind = "sort" if p.startswith("sort") else "add"
            total[kind] += 1
            right[kind] += t == tasks.solve(p)
            if t != tasks.solve(p) and len(wrong) < 20:
                wrong.append({"prompt": p, "answer": t, "expected": tasks.solve(p)})
    gen = engine.generation_config()
    return {"accuracy": sum(right.values()) / sum(total.values()),
            "by_task": {k: right[k] / total[k] for k in sorted(total)}, "count": sum(total.values()),
            "seconds": time.perf_counter() - t0, "device": device, "dtype": dtype, "path": "planned",
            "max_new_tokens": gen.max_new_tokens, "steps": gen.steps, "examples_wrong": wrong}


def record_header(config: dict) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from common import record_header as header
    return header(config)


# -- training --------------------------------------------------------------------------------------

def train(args, arch: str, out: Path) -> dict:
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    vocab = tasks.vocab()
    kv = args.kv_heads or (2 if arch == "dream" else args.heads)
    model = Tiny(len(vocab), arch, args.d, args.layers, args.heads, kv, args.ffn).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[{arch}] {n_params / 1e6:.2f} M parameters ({2 * n_params / 1e6:.1f} MB in bf16), "
          f"d {args.d}, {args.layers} layers, {args.heads} heads ({kv} kv), ffn {args.ffn}", flush=True)
    sampler = Sampler(vocab, dev, args.seed, args.add_share, args.add3_share, tasks.held_out())
    cuda = dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                            betas=(0.9, 0.98), **({"fused": True} if cuda else {}))
    mask_id = vocab["<|mask|>"]
    ans = slice(PROMPT, PROMPT + ANS)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    budget = args.time_budget if cuda or args.time_budget_cpu else 0
    chunk, buf, step, progress = 16, None, 0, 0.0
    log = []
    t0 = time.perf_counter()
    while progress < 1.0:
        elapsed = time.perf_counter() - t0
        progress = max(step / args.steps, elapsed / budget if budget else 0.0)
        if progress >= 1.0:
            break
        warm = min(1.0, (step + 1) / args.warmup)
        lr = args.lr * warm * (args.min_lr + (1 - args.min_lr) * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        if buf is None or buf[0].shape[0] < args.batch:  # draw `chunk` batches at once
            hard_share = args.hard * min(1.0, progress / 0.2)
            buf = sampler.rows(chunk * args.batch, hard_share)
        ids, valid, keep, is_add = (t[:args.batch] for t in buf)
        buf = tuple(t[args.batch:] for t in buf)
        B = ids.shape[0]
        # LLaDA's answer masking: k ~ U{1..ANS} tokens (t ~ U(0,1), Bernoulli(t) each, k >= 1)
        k = torch.randint(1, ANS + 1, (B, 1), device=dev)
        masked = torch.rand(B, ANS, device=dev).argsort(1).argsort(1) < k
        noisy = ids.clone()
        noisy[:, ans] = torch.where(masked, mask_id, ids[:, ans])
        with amp:
            logits = model(noisy, valid, rows=ans)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, ans].reshape(-1),
                             reduction="none").view(B, ANS)
        per_row = (ce * masked).sum(1) / k.squeeze(1)          # 1/t weighting with t = k / ANS
        w = keep.float()
        loss = (per_row * w).sum() / w.sum().clamp_min(1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == 1:
            with torch.no_grad():
                wa, ws = w * is_add, w * ~is_add
                la = ((per_row * wa).sum() / wa.sum().clamp_min(1)).item()
                ls = ((per_row * ws).sum() / ws.sum().clamp_min(1)).item()
            rec = {"step": step, "loss": round(loss.item(), 4), "loss_add": round(la, 4),
                   "loss_sort": round(ls, 4), "lr": lr, "seconds": round(time.perf_counter() - t0, 1)}
            log.append(rec)
            print(f"[{arch}] step {step:6d} loss {rec['loss']:.4f} (add {la:.4f}, sort {ls:.4f}) "
                  f"lr {lr:.2e} {rec['seconds']:.0f}s", flush=True)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    print(f"[{arch}] {step} steps in {seconds:.1f} s ({1e3 * seconds / max(step, 1):.2f} ms a step, "
          f"{step * args.batch / seconds:,.0f} rows/s)", flush=True)
    meta = {"arch": arch, "steps": step, "batch": args.batch, "lr": args.lr, "min_lr": args.min_lr,
            "warmup": args.warmup, "weight_decay": args.weight_decay, "seed": args.seed,
            "max_steps": args.steps, "time_budget_s": budget, "train_seconds": round(seconds, 1),
            "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
            "d_model": args.d, "layers": args.layers, "heads": args.heads, "kv_heads": kv, "ffn": args.ffn,
            "parameters": n_params, "add_share": args.add_share, "add3_share": args.add3_share,
            "hard_carry_share": args.hard, "objective": "LLaDA SFT masking of the answer, k~U{1..8}, "
            "loss = masked CE / k", "final_loss": log[-1] if log else None}
    save(model, vocab, out, meta)
    model.eval()
    gap = engine_logits_gap(model, out, dev)
    print(f"[{arch}] saved {out}; engine forward vs training forward: max |logit gap| {gap:.2e}", flush=True)
    return {"meta": meta, "gap": gap}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=["llada", "dream", "both"], default="llada")
    ap.add_argument("--out", type=Path, required=True, help="model folders go to OUT/tiny-<arch>")
    ap.add_argument("--pack", type=Path, help="also write PACK/tiny-<arch>.tar and the accuracy records there")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=40000, help="at most this many steps")
    ap.add_argument("--time-budget", type=float, default=75.0,
                    help="seconds of training a model on CUDA (the schedule ends there); 0: steps only")
    ap.add_argument("--time-budget-cpu", action="store_true", help="apply --time-budget on the CPU too")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr", type=float, default=0.05, help="final learning rate, a fraction of --lr")
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--d", type=int, default=GEOMETRY["d"])
    ap.add_argument("--layers", type=int, default=GEOMETRY["layers"])
    ap.add_argument("--heads", type=int, default=GEOMETRY["heads"])
    ap.add_argument("--kv-heads", type=int, default=0, help="0: all heads (llada), 2 (dream)")
    ap.add_argument("--ffn", type=int, default=GEOMETRY["ffn"])
    ap.add_argument("--add-share", type=float, default=0.5, help="share of addition rows (tasks: 0.25)")
    ap.add_argument("--add3-share", type=float, default=0.7, help="share of 3-digit additions among them")
    ap.add_argument("--hard", type=float, default=0.4, help="final share of additions with forced carries")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=1000)
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--eval-per-shape", type=int, default=100, help="held-out prompts a shape (tasks: 100)")
    ap.add_argument("--eval-dtypes", default=None, help="default: float32,bfloat16 on CUDA, float32 on the CPU")
    return ap


def main():
    args = parser().parse_args()
    dtypes = (args.eval_dtypes or ("float32,bfloat16" if args.device.startswith("cuda") else "float32")).split(",")
    archs = ["llada", "dream"] if args.arch == "both" else [args.arch]
    report = args.pack or args.out
    report.mkdir(parents=True, exist_ok=True)
    rows = []
    for arch in archs:
        name = f"tiny-{arch}"
        folder = args.out / name
        res = train(args, arch, folder)
        row = {"model": name, "steps": res["meta"]["steps"], "seconds": res["meta"]["train_seconds"],
               "gap": res["gap"]}
        if not args.no_eval:
            header = record_header({"model": name, "folder": str(folder), "per_shape": args.eval_per_shape})
            for dtype in dtypes:
                try:
                    row[dtype] = evaluate(folder, args.device, dtype, args.eval_per_shape)
                except Exception as e:  # report and go on: the checkpoint is already saved
                    row[dtype] = {"error": f"{type(e).__name__}: {e}"}
                e = row[dtype]
                said = e["error"] if "error" in e else f"{json.dumps(e['by_task'])}, all {e['accuracy']:.2%}"
                print(f"[{arch}] held-out prompts ({dtype}): {said}", flush=True)
            main_rec = next((row[d] for d in dtypes if "error" not in row[d]), row[dtypes[0]])
            rec = {**header, **main_rec, "by_dtype": {d: row[d] for d in dtypes}, "training": res["meta"],
                   "engine_logit_gap": res["gap"]}
            (report / f"tiny_accuracy_{name}.json").write_text(json.dumps(rec, indent=2) + "\n")
        if args.pack:
            with tarfile.open(args.pack / f"{name}.tar", "w") as tar:
                tar.add(folder, arcname=name)
        rows.append(row)
    print(f"\n{'model':<11} {'steps':>6} {'train s':>8} {'logit gap':>9}  {'dtype':<8} "
          f"{'add':>7} {'sort':>7} {'all':>7}")
    for r in rows:
        for dtype in dtypes if not args.no_eval else ("-",):
            e = r.get(dtype, {})
            acc = ["-"] * 3 if "by_task" not in e else \
                [f"{e['by_task'].get('add', 0):.1%}", f"{e['by_task'].get('sort', 0):.1%}", f"{e['accuracy']:.1%}"]
            print(f"{r['model']:<11} {r['steps']:>6} {r['seconds']:>8.1f} {r['gap']:>9.1e}  {dtype:<8} "
                  f"{acc[0]:>7} {acc[1]:>7} {acc[2]:>7}")


if __name__ == "__main__":
    main()
