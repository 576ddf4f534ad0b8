"""Train the bundled tiny masked-diffusion models on mosaic/assets/tasks.py (CPU, minutes).

    python tools/train_tiny.py --arch llada --out mosaic/assets/tiny-llada
    python tools/train_tiny.py --arch dream --out mosaic/assets/tiny-dream

The model here is a compact autograd implementation used only for training; the engine's own
forward is checked against an independent implementation in tests/. Weights are saved in the
published key layout (LLaDA: model.transformer.*, Dream: Qwen2 names) in bfloat16.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from mosaic.assets import tasks

D, LAYERS, HEADS, FFN = 128, 4, 4, 384


class Tiny(torch.nn.Module):
    def __init__(self, vocab: int, arch: str):
        super().__init__()
        self.arch = arch
        kv_heads = 2 if arch == "dream" else HEADS
        hd = D // HEADS
        self.kv_heads, self.hd = kv_heads, hd
        self.emb = torch.nn.Embedding(vocab, D)
        bias = arch == "dream"
        self.blocks = torch.nn.ModuleList()
        for _ in range(LAYERS):
            b = torch.nn.Module()
            b.n1 = torch.nn.Parameter(torch.ones(D))
            b.q = torch.nn.Linear(D, HEADS * hd, bias=bias)
            b.k = torch.nn.Linear(D, kv_heads * hd, bias=bias)
            b.v = torch.nn.Linear(D, kv_heads * hd, bias=bias)
            b.o = torch.nn.Linear(HEADS * hd, D, bias=False)
            b.n2 = torch.nn.Parameter(torch.ones(D))
            b.gate = torch.nn.Linear(D, FFN, bias=False)
            b.up = torch.nn.Linear(D, FFN, bias=False)
            b.down = torch.nn.Linear(FFN, D, bias=False)
            self.blocks.append(b)
        self.nf = torch.nn.Parameter(torch.ones(D))
        self.head = torch.nn.Linear(D, vocab, bias=False)
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    @staticmethod
    def norm(x, w, eps=1e-5):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(self, t, L):
        f = torch.arange(L, dtype=torch.float32)[:, None] * self.inv_freq[None]
        cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
        h = t.shape[-1] // 2
        return t * cos + torch.cat([-t[..., h:], t[..., :h]], -1) * sin

    def forward(self, ids):
        B, L = ids.shape
        x = self.emb(ids)
        for b in self.blocks:
            h = self.norm(x, b.n1)
            q = self.rope(b.q(h).view(B, L, HEADS, self.hd).transpose(1, 2), L)
            k = self.rope(b.k(h).view(B, L, self.kv_heads, self.hd).transpose(1, 2), L)
            v = b.v(h).view(B, L, self.kv_heads, self.hd).transpose(1, 2)
            rep = HEADS // self.kv_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, D)
            x = x + b.o(o)
            h = self.norm(x, b.n2)
            x = x + b.down(F.silu(b.gate(h)) * b.up(h))
        logits = self.head(self.norm(x, self.nf))
        if self.arch == "dream":  # position j is predicted from hidden state j-1
            logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)
        return logits

    def state_dict_published(self) -> dict[str, torch.Tensor]:
        out = {}
        if self.arch == "llada":
            p = "model.transformer."
            out[p + "wte.weight"] = self.emb.weight
            for i, b in enumerate(self.blocks):
                q = f"{p}blocks.{i}."
                out |= {q + "attn_norm.weight": b.n1, q + "q_proj.weight": b.q.weight,
                        q + "k_proj.weight": b.k.weight, q + "v_proj.weight": b.v.weight,
                        q + "attn_out.weight": b.o.weight, q + "ff_norm.weight": b.n2,
                        q + "ff_proj.weight": b.gate.weight, q + "up_proj.weight": b.up.weight,
                        q + "ff_out.weight": b.down.weight}
            out[p + "ln_f.weight"] = self.nf
            out[p + "ff_out.weight"] = self.head.weight
        else:
            out["model.embed_tokens.weight"] = self.emb.weight
            for i, b in enumerate(self.blocks):
                q = f"model.layers.{i}."
                a = q + "self_attn."
                out |= {q + "input_layernorm.weight": b.n1,
                        q + "post_attention_layernorm.weight": b.n2,
                        a + "o_proj.weight": b.o.weight, q + "mlp.gate_proj.weight": b.gate.weight,
                        q + "mlp.up_proj.weight": b.up.weight, q + "mlp.down_proj.weight": b.down.weight}
                for n in "qkv":
                    lin = getattr(b, n)
                    out[a + f"{n}_proj.weight"] = lin.weight
                    out[a + f"{n}_proj.bias"] = lin.bias
            out["model.norm.weight"] = self.nf
            out["lm_head.weight"] = self.head.weight
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in out.items()}


def encode(vocab, prompt: str) -> list[int]:
    return [vocab["<|bos|>"]] + [vocab[c] for c in prompt]


def make_batch(rng, vocab, batch, exclude):
    kind, size = rng.choice(tasks.shapes())
    rows, plen = [], None
    while len(rows) < batch:
        prompt = tasks.sample(rng, kind, size)
        if prompt in exclude or (plen is not None and len(prompt) + 1 != plen):
            continue  # one prompt length per batch: no padding needed
        ans = [vocab[c] for c in tasks.solve(prompt)]
        ans += [vocab["<|eos|>"]] * (tasks.ANSWER_LEN - len(ans))
        ids = encode(vocab, prompt)
        plen = len(ids)
        rows.append(ids + ans)
    return torch.tensor(rows), plen


def build_tokenizer(vocab: dict[str, int]) -> Tokenizer:
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|eos|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(tasks.SPECIALS))
    return tok


def save(model: Tiny, vocab: dict[str, int], out: Path, arch: str, meta: dict):
    out.mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict_published(), str(out / "model.safetensors"), metadata={"format": "pt"})
    ids = {k: vocab[f"<|{k}|>"] for k in ("bos", "eos", "mask", "eot")}
    if arch == "llada":
        cfg = {"model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": D,
               "n_layers": LAYERS, "n_heads": HEADS, "n_kv_heads": HEADS, "mlp_hidden_size": FFN,
               "mlp_ratio": 3, "vocab_size": len(vocab), "embedding_size": len(vocab),
               "rope_theta": 10000.0, "rope_full_precision": True, "rms_norm_eps": 1e-5,
               "max_sequence_length": 64, "include_bias": False, "weight_tying": False,
               "activation_type": "silu", "block_type": "llama",
               "mask_token_id": ids["mask"], "eos_token_id": ids["eos"], "pad_token_id": ids["eos"],
               "bos_token_id": ids["bos"], "eot_token_id": ids["eot"]}
    else:
        cfg = {"model_type": "Dream", "architectures": ["DreamModel"], "hidden_size": D,
               "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
               "num_key_value_heads": model.kv_heads, "intermediate_size": FFN,
               "vocab_size": len(vocab), "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
               "max_position_embeddings": 64, "tie_word_embeddings": False,
               "mask_token_id": ids["mask"], "pad_token_id": ids["eos"],
               "eos_token_id": ids["eos"], "bos_token_id": ids["bos"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"max_new_tokens": tasks.ANSWER_LEN, "steps": tasks.ANSWER_LEN}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    build_tokenizer(vocab).save(str(out / "tokenizer.json"))
    tok_cfg = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "mask_token": "<|mask|>",
               "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
               "add_bos_token": True}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=["llada", "dream"], default="llada")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    vocab = tasks.vocab()
    exclude = set(tasks.held_out())
    model = Tiny(len(vocab), args.arch)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    mask_id = vocab["<|mask|>"]
    t0 = time.time()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 200) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, plen = make_batch(rng, vocab, args.batch, exclude)
        B, L = ids.shape
        # LLaDA SFT objective: mask each answer token with probability t, weight the loss by 1/t
        t = torch.rand(B, 1).clamp_min(1e-3)
        masked = torch.rand(B, L) < t
        masked[:, :plen] = False
        masked[masked.sum(1) == 0, plen] = True
        noisy = torch.where(masked, torch.full_like(ids, mask_id), ids)
        logits = model(noisy)
        ce = F.cross_entropy(logits[masked], ids[masked], reduction="none")
        loss = (ce / t.expand(B, L)[masked]).sum() / (B * tasks.ANSWER_LEN)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 200 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.4f} lr {lr:.2e} {time.time() - t0:.0f}s", flush=True)
        if step % 1000 == 999:
            save(model, vocab, args.out, args.arch, {"steps": step + 1})
    meta = {"arch": args.arch, "steps": args.steps, "batch": args.batch, "lr": args.lr,
            "seed": args.seed, "train_seconds": round(time.time() - t0, 1),
            "d_model": D, "layers": LAYERS, "heads": HEADS, "ffn": FFN}
    save(model, vocab, args.out, args.arch, meta)


if __name__ == "__main__":
    main()
