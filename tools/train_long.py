"""Train the bundled long-context model (tiny-long) on mosaic/assets/long_tasks.py, then measure
it through the engine: the quality oracle for lossy options (sparse attention, caches, FP8).

    # one H200, about 4 minutes of training + 1 minute of evaluation (30 prompts per cell)
    python tools/train_long.py --device cuda --out $OUT/tiny-long --time-budget-s 235 --eval-n 30
    # CPU smoke test: tiny model, short contexts, a few steps
    python tools/train_long.py --device cpu --out /tmp/tl --d 64 --layers 2 --heads 2 --ffn 128 \
        --max-steps 20 --min-len 256 --max-len 512 --eval-lengths 512 --eval-n 4

The model is LLaDA's architecture (pre-norm RMSNorm, RoPE, SwiGLU, no biases, bidirectional
attention) in a compact autograd form used only here; it is saved in the published LLaDA key
layout (model.transformer.*) in bfloat16, so the engine loads it like any LLaDA checkpoint.

Objective: LLaDA's SFT loss. Only the ANSWER_LEN answer tokens are ever masked, each with
probability t ~ U(0, 1) per example (at least one); cross-entropy on the masked tokens. We take
the plain mean over masked tokens rather than LLaDA's 1/t weighting: every answer here is a
deterministic function of the prompt, so both weightings have the same optimum (the one-hot
answer at every masked slot), and the plain mean avoids the large gradient variance of 1/t
when t is small (a 1/t-weighted batch is dominated by its few nearly unmasked examples).

Curriculum: five stages of context lengths, 64-256 tokens (a handful of records: the lookup
circuit forms on cheap steps with big batches), 128-1k, 512-4k, 2k-8k and finally 4k-16k
(sharp attention at the evaluated lengths; relative positions up to 16k seen). A stage is left
once the answer-character accuracy on masked slots (running average over training batches) of
every task in --gate-tasks (kv, niah) reaches --advance-acc, or at its latest end (a fraction
of the budget: time, or --max-steps), so whatever the early stages leave goes to the later,
expensive ones. About --tokens-per-step tokens per step at every length (batch = tokens /
length, within [--min-batch, --max-batch]). A checkpoint is written at every stage change and
at the end; training stops at --time-budget-s, then the held-out sets are evaluated through
MosaicEngine until --deadline-s after start (a cell left unfinished is marked partial) and
long_accuracy.json is written next to the model.

Structured initialisation (the recipe; --init-offsets, --init-match). From random init the
retrieval circuit never formed in our budgets (two H200 runs of ~6 min, 5-6k steps: answers at
chance at every length; on CPU, d 128, 2 layers, kv at L=64 with 4 queries, batch 64, lr 2e-3:
answer-value accuracy 0.006 after 600 steps). Retrieval of a one-token key is two-hop induction:
a head that copies the token `o` before into each position, then a head that matches the asked
key against those copies and reads the value there. So both hops are written in at init:
  - layer 0, head j: a fixed-offset head (init_offset_heads): every embedding gets a shared
    direction u, q and k are constant vectors built from u over the 16 fastest RoPE pairs with
    weights (offset_weights) and phases that peak the score at relative offset o_j (peak logit
    60, any other offset within 16k at most 0.75 of it: the head is one-hot at 16k, tested);
    V/O copy the token's identity into a fresh random subspace;
  - layer 1, head j: a matching head (init_match_heads) whose q and k both read what head j of
    layer 0 wrote, in the slowest RoPE pairs (nearly position-free), plus a large negative score
    on masked positions (with q = k a query would otherwise attend to itself: the answer slot's
    own offset copy is the asked key too); V/O copy the token there.
  Offsets 1, 2 serve the two value words of kv/niah; 1..4 the four words of copy.
All weights stay trainable; the model and loss are unchanged. The init matches only roughly
(random projections: at L=64 head 0 sends the first answer slot to the right record 48% of the
time) and training sharpens it, but only at a moderate learning rate: at 2e-3 Adam wipes the
structure out in ~100 steps (offset heads gone, matching 0%, accuracy 0.003); at 3e-4 the
matching reached 97% by step 200 and kv answer-value accuracy 0.54 at step 250, 0.96 at 300,
0.98 at 350 (constant lr, same CPU setting; /tmp experiments). Not enough on their own: offset
heads without the matching init at 3e-4 (matching never formed: accuracy 0.005 at step 400), or
head dim 32 (d 128, 4 heads, 8 slow pairs: the initial match 19% collapses to 0 by step 100).

    # CPU smoke of the recipe (2 cores, ~4 minutes + evaluation): kv accuracy should pass 0.9
    python tools/train_long.py --device cpu --out /tmp/tl --d 128 --layers 2 --heads 2 --ffn 256 \
        --max-steps 700 --stages 1.0:64:64 --tokens-per-step 4096 --workers 0 --log-every 50 \
        --tasks kv --weights 1 --queries 4 --init-offsets 1,2 --match-slow-pairs 16 --warmup 50 \
        --eval-lengths 64 --eval-n 50

On the GPU (one H200, 235 s of training, commit 6fc77e5, bench/results/gpu/train_long_4layers_
6fc77e5.log): with 4 layers the recipe learnt every task. kv/niah accuracy on training batches
went from ~0.01 to 0.5 at step ~1,250 (64-256 tokens) and to 0.92-0.99 by step 2,250, the later
stages were left as soon as learnt, and the held-out sets through MosaicEngine (30 prompts per
cell) gave kv 100% / 100% / 83.3%, niah 100% / 96.7% / 96.7%, copy 100% / 100% / 93.3% at
4k / 8k / 16k. The same run with 8 layers (train_long_8layers_6fc77e5.log) stayed at chance for
kv and niah (copy 0.1-0.2): the four randomly initialised layers above the two structured ones
seem to drown the circuit at this learning rate; 4 layers is the default. The 16k cells are the
weakest: 16 slow pairs are position-free only to a few thousand tokens at theta 5e5.

Model size: d 256, 4 layers of 4 heads (head dim 64: enough RoPE dimensions turn slowly enough
at theta 5e5 to match keys 16k tokens apart), SwiGLU 768: ~4 M parameters, ~8 MiB in bf16.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mosaic.assets import long_tasks as T  # noqa: E402

T_START = time.monotonic()
VOCAB = T.vocab()
EXCLUDE: set[bytes] = set()   # digests of held-out prompts (set before the workers fork)


# ----------------------------------------------------------------------------- data

def make_batch(seed: int, length: int, batch: int, tasks: tuple[str, ...], weights: tuple[float, ...],
               queries: int = 1):
    """Rows of one length, drawn in a worker process: ids [batch, length + ANSWER_LEN] int64 (BOS,
    prompt, answer + end-of-text), sup [batch, length + ANSWER_LEN] bool (the tokens the loss may
    mask: the answer slots and the values of earlier answered queries), and the task index of
    each row. A row of kv/niah has 1..queries queries (uniform); held-out prompts are skipped."""
    rng = np.random.default_rng(seed)
    ids = np.empty((batch, length + T.ANSWER_LEN), dtype=np.int64)
    sup = np.zeros_like(ids, dtype=bool)
    kinds = rng.choice(len(tasks), batch, p=np.asarray(weights) / sum(weights))
    qs = np.where([tasks[k] == "copy" for k in kinds], 1, rng.integers(1, queries + 1, size=batch))
    ids[:, 0] = T.BOS
    sup[:, length:] = True
    for k, q in sorted(set(zip(kinds.tolist(), qs.tolist()))):
        rows = np.flatnonzero((kinds == k) & (qs == q))
        prompt, ans, _, cols = T.batch(rng, tasks[k], length, len(rows), q)
        if length in T.LENGTHS:  # a held-out prompt is drawn again (the chance is nil; checked anyway)
            for j, r in enumerate(prompt):
                while T.digest(r) in EXCLUDE:
                    again = T.batch(rng, tasks[k], length, 1, q)
                    r[:], ans[j] = again[0][0], again[1][0]
        ids[rows, 1:length] = prompt
        ids[rows, length:] = ans
        sup[rows[:, None], 1 + cols] = True
    return ids, sup, kinds


def stages(args) -> list[tuple[float, int, int]]:
    """(end fraction of the budget, shortest, longest context) per curriculum stage."""
    out = []
    for spec in args.stages.split(","):
        end, lo, hi = spec.split(":")
        out.append((float(end), max(int(lo), args.min_len), min(int(hi), args.max_len)))
    return out


def pick_length(rng: random.Random, lo: int, hi: int) -> int:
    """Log-uniform in [lo, hi], a multiple of 16 (or lo itself when lo == hi)."""
    if lo >= hi:
        return hi
    L = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    return max(lo, min(hi, int(round(L / 16)) * 16))


# ----------------------------------------------------------------------------- model

class LongLLaDA(torch.nn.Module):
    """LLaDA blocks; q/k/v and gate/up fused for speed, split again when saved."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, ffn: int, theta: float):
        super().__init__()
        self.d, self.heads, self.hd, self.ffn, self.theta = d, heads, d // heads, ffn, theta
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            b = torch.nn.Module()
            b.n1 = torch.nn.Parameter(torch.ones(d))
            b.qkv = torch.nn.Linear(d, 3 * d, bias=False)
            b.o = torch.nn.Linear(d, d, bias=False)
            b.n2 = torch.nn.Parameter(torch.ones(d))
            b.gate_up = torch.nn.Linear(d, 2 * ffn, bias=False)
            b.down = torch.nn.Linear(ffn, d, bias=False)
            self.blocks.append(b)
        self.nf = torch.nn.Parameter(torch.ones(d))
        self.head = torch.nn.Linear(d, vocab, bias=False)
        for n, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if n.endswith(("o.weight", "down.weight")) else 0.02
                torch.nn.init.normal_(p, std=std)
        inv = 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        self.register_buffer("inv_freq", inv, persistent=False)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def rope_tables(self, L: int):
        """cos, sin [L, hd] in fp32 for positions 0..L-1 (one table, grown to the longest L)."""
        if self._rope is None or self._rope[0].shape[0] < L:
            n = max(L, 1024)
            f = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)[:, None] * self.inv_freq
            f = torch.cat([f, f], -1)
            self._rope = (f.cos(), f.sin())
        return self._rope[0][:L], self._rope[1][:L]

    @staticmethod
    def rope(t, cos, sin):
        """Rotate-half RoPE in fp32 (LLaDA's rope_full_precision), back to t's dtype."""
        x = t.float()
        h = x.shape[-1] // 2
        return (x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin).to(t.dtype)

    def forward(self, ids: torch.Tensor, out_from: int) -> torch.Tensor:
        """Logits of positions out_from: (the answer slots) only."""
        B, L = ids.shape
        cos, sin = self.rope_tables(L)
        x = self.emb(ids)
        for b in self.blocks:
            h = F.rms_norm(x, (self.d,), b.n1, 1e-5)
            q, k, v = b.qkv(h).view(B, L, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(self.rope(q, cos, sin), self.rope(k, cos, sin), v)
            x = x + b.o(o.transpose(1, 2).reshape(B, L, self.d))
            h = F.rms_norm(x, (self.d,), b.n2, 1e-5)
            g, u = b.gate_up(h).chunk(2, -1)
            x = x + b.down(F.silu(g) * u)
        x = F.rms_norm(x[:, out_from:], (self.d,), self.nf, 1e-5)
        return self.head(x)

    def published(self) -> dict[str, torch.Tensor]:
        p = "model.transformer."
        out = {p + "wte.weight": self.emb.weight}
        for i, b in enumerate(self.blocks):
            q = f"{p}blocks.{i}."
            wq, wk, wv = b.qkv.weight.chunk(3, 0)
            gate, up = b.gate_up.weight.chunk(2, 0)
            out |= {q + "attn_norm.weight": b.n1, q + "q_proj.weight": wq, q + "k_proj.weight": wk,
                    q + "v_proj.weight": wv, q + "attn_out.weight": b.o.weight,
                    q + "ff_norm.weight": b.n2, q + "ff_proj.weight": gate, q + "up_proj.weight": up,
                    q + "ff_out.weight": b.down.weight}
        out[p + "ln_f.weight"] = self.nf
        out[p + "ff_out.weight"] = self.head.weight
        return {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in out.items()}


def offset_weights(hd: int, theta: float, span: int, pairs: int = 16, iters: int = 300) -> torch.Tensor:
    """Weights r (>= 0, sum 1) of the fastest `pairs` RoPE pairs such that sum_i r_i cos(delta
    theta_i) is as far below its peak (delta = 0) as possible for every 0 < |delta| <= span: the
    score profile of a fixed-offset head. A smooth max (log-sum-exp) minimised over the simplex;
    at head dim 64, theta 5e5, span 16k the worst other offset scores ~0.75 of the peak (the LP
    optimum is 0.744; equal weights: 0.93, at the neighbouring offsets)."""
    pairs = min(pairs, hd // 2)
    th = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64)[:pairs] / hd))
    C = torch.cos(torch.arange(1, span + 1, dtype=torch.float64)[:, None] * th)    # [span, pairs]
    z = torch.zeros(pairs, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([z], lr=0.05)
    with torch.enable_grad():
        for i in range(iters):
            beta = 20.0 + 180.0 * i / iters
            loss = torch.logsumexp(beta * (C @ torch.softmax(z, 0)), 0) / beta
            opt.zero_grad()
            loss.backward()
            opt.step()
    return torch.softmax(z.detach(), 0)


@torch.no_grad()
def init_offset_heads(model: LongLLaDA, offsets: tuple[int, ...], peak: float = 60.0, span: int = 16400,
                      shared: float = 2.0, seed: int = 1234) -> dict:
    """Structured initialisation of layer 0: head j attends from every position m to m - offsets[j]
    (a previous-token head for offset 1; negative offsets look ahead) and writes that token's
    identity into the residual through its own fresh subspace. The two-hop induction circuit
    of retrieval (this head, then a content-matching head) then needs only its second hop learnt.

    - every token embedding gets a shared component `shared` x (embedding row rms norm) along a
      fixed unit direction u (the random rows lose their part along u);
    - q and k of head j are then constant (rank-1 W_Q, W_K reading u), over the fastest RoPE
      pairs, with phases exp(-i o theta_p) in q: the score of relative offset m - n is
      peak * sum_p r_p cos((m - n - o) theta_p), largest at m - n = o and at most ~0.75 peak
      elsewhere within `span` (offset_weights): a logit gap of ~15 at peak 60, sharp at 16k;
    - W_V of head j: a random orthonormal projection of the token part (orthogonal to u); W_O:
      random orthonormal columns (orthogonal to u), scaled so the head writes about the norm of
      an embedding row.
    Every weight stays trainable. Returns {"u": u, "r": r} (for tests)."""
    d, hd, H = model.d, model.hd, model.heads
    assert len(offsets) <= H, (offsets, H)
    g = torch.Generator().manual_seed(seed)
    dev = model.emb.weight.device
    E = model.emb.weight.data.float().cpu()
    u = torch.randn(d, generator=g, dtype=torch.float64).float()
    u /= u.norm()
    E -= E @ u[:, None] * u[None]
    row = E.norm(dim=1).mean()
    E += shared * row * u
    model.emb.weight.data.copy_(E.to(dev))
    h = F.rms_norm(E, (d,), model.blocks[0].n1.detach().float().cpu(), 1e-5)
    gu = float((h @ u).mean())                               # u . h of every token (about equal)
    tok = (h - (h @ u)[:, None] * u).norm(dim=1).mean()      # norm of the token part after the norm
    r = offset_weights(hd, model.theta, span)
    th = model.inv_freq.detach().double().cpu()[: len(r)]
    b = model.blocks[0]
    W = b.qkv.weight.data.float().cpu()                      # [3d, d]: q rows, k rows, v rows
    Wo = b.o.weight.data.float().cpu()                       # [d, d]: columns = head outputs
    P = torch.eye(d) - u[:, None] * u[None]                  # projector orthogonal to u
    outs = []
    for j, o in enumerate(offsets):
        amp = torch.sqrt(peak * math.sqrt(hd) * r) / gu      # per pair: |q_p| = |k_p| = amp
        qv, kv = torch.zeros(hd), torch.zeros(hd)
        n = len(r)
        qv[:n] = (amp * torch.cos(o * th)).float()
        qv[hd // 2: hd // 2 + n] = (-amp * torch.sin(o * th)).float()
        kv[:n] = amp.float()
        W[j * hd:(j + 1) * hd] = qv[:, None] * u[None]
        W[d + j * hd:d + (j + 1) * hd] = kv[:, None] * u[None]
        A = torch.linalg.qr(P @ torch.randn(d, hd, generator=g))[0]     # [d, hd] orthonormal, _|_ u
        B = torch.linalg.qr(P @ torch.randn(d, hd, generator=g))[0]
        W[2 * d + j * hd:2 * d + (j + 1) * hd] = A.T                      # value: token part -> hd
        Wo[:, j * hd:(j + 1) * hd] = B * (row / (tok * math.sqrt(hd / d)))
        outs.append(B)
    b.qkv.weight.data.copy_(W.to(dev))
    b.o.weight.data.copy_(Wo.to(dev))
    return {"u": u, "r": r, "out": outs}


@torch.no_grad()
def init_match_heads(model: LongLLaDA, layer: int, out: list[torch.Tensor], u: torch.Tensor, slow_pairs: int = 8,
                     peak: float = 30.0, mask_penalty: float = 30.0, seed: int = 4321) -> None:
    """Layer `layer`, head j: content matching on what offset head j of layer 0 wrote (its
    subspace out[j], [d, hd]): q and k both read that subspace into the `slow_pairs` slowest RoPE
    pairs (nearly position-free), so a query attends to the positions whose token at the same
    offset is its own; value: the token there (random orthonormal projection), written back at
    about an embedding row's norm."""
    d, hd = model.d, model.hd
    g = torch.Generator().manual_seed(seed)
    dev = model.emb.weight.device
    b = model.blocks[layer]
    W = b.qkv.weight.data.float().cpu()
    Wo = b.o.weight.data.float().cpu()
    # the norm of a layer-0 offset feature after this layer's RMSNorm: measure on random tokens
    ids = torch.randint(model.emb.num_embeddings, (4, 256), generator=g)
    ids[:, ::7] = T.MASK
    ids = ids.to(dev)
    x = model.emb(ids)
    b0 = model.blocks[0]
    B_, L = ids.shape
    cos, sin = model.rope_tables(L)
    h = F.rms_norm(x, (d,), b0.n1, 1e-5)
    q, k, v = b0.qkv(h).view(B_, L, 3, model.heads, hd).permute(2, 0, 3, 1, 4)
    o = F.scaled_dot_product_attention(model.rope(q, cos, sin), model.rope(k, cos, sin), v)
    x = x + b0.o(o.transpose(1, 2).reshape(B_, L, d))
    gt, up = b0.gate_up(F.rms_norm(x, (d,), b0.n2, 1e-5)).chunk(2, -1)
    x = x + b0.down(F.silu(gt) * up)
    h1 = F.rms_norm(x, (d,), b.n1, 1e-5).float().cpu().reshape(-1, d)
    E = model.emb.weight.data.float().cpu()
    # content: the slow pairs but the slowest; the slowest pair's first dim: the mask penalty
    idx = torch.cat([torch.arange(hd // 2 - slow_pairs, hd // 2 - 1), torch.arange(hd - slow_pairs, hd - 1)])
    ids_h = ids.reshape(-1).cpu()
    mdir = E[T.MASK] - (E[T.MASK] @ u) * u
    mdir /= mdir.norm()
    mk = h1 @ mdir                                           # large at masked positions only
    gm = float(mk[ids_h == T.MASK].mean()) if (ids_h == T.MASK).any() else float(mk.abs().max())
    gu1 = float((h1 @ u).mean())
    for j, Bj in enumerate(out):
        f = h1 @ Bj                                          # [N, hd] the feature
        fn = f.norm(dim=1).mean()
        G = torch.linalg.qr(torch.randn(hd, len(idx), generator=g))[0].T   # [n, hd] orthonormal rows
        s = math.sqrt(peak * math.sqrt(hd)) / (fn * math.sqrt(len(idx) / hd))
        Wq = torch.zeros(hd, d)
        Wk = torch.zeros(hd, d)
        Wq[idx] = s * (G @ Bj.T)
        Wk[idx] = s * (G @ Bj.T)
        c = math.sqrt(mask_penalty * math.sqrt(hd))
        Wq[hd // 2 - 1] = (c / gu1) * u                    # constant
        Wk[hd // 2 - 1] = -(c / gm) * mdir                  # -c at a masked position
        W[j * hd:(j + 1) * hd] = Wq
        W[d + j * hd:d + (j + 1) * hd] = Wk
        A = torch.linalg.qr(torch.randn(d, hd, generator=g))[0]
        Bo = torch.linalg.qr(torch.randn(d, hd, generator=g))[0]
        W[2 * d + j * hd:2 * d + (j + 1) * hd] = A.T
        tokn = (h1 @ A).norm(dim=1).mean()
        Wo[:, j * hd:(j + 1) * hd] = Bo * (E.norm(dim=1).mean() / tokn)
    b.qkv.weight.data.copy_(W.to(dev))
    b.o.weight.data.copy_(Wo.to(dev))


def train_flops(params_matmul: int, d: int, layers: int, B: int, L: int) -> float:
    """Forward + backward FLOPs of one step: 6 per weight per token, and attention's
    QK^T and PV (4 L^2 d per layer forward, ~3.5x that with the backward)."""
    return 6 * params_matmul * B * L + 14 * B * L * L * d * layers


def masked_loss(model: LongLLaDA, ids: torch.Tensor, sup: torch.Tensor, start: int, amp, generator=None):
    """LLaDA's SFT loss on one batch: t ~ U(0, 1) per row, each token the loss may mask (sup)
    masked with probability t, at least one answer slot; cross-entropy (plain mean) on the masked
    tokens. ids, sup [B, L + ANSWER_LEN]; start: the first column with a supervised token (read
    on the host, before sup goes to the device). Returns (loss, logits [B, L', V], masked [B, L'],
    targets [B, L']) over the columns from start on (L' = L + ANSWER_LEN - start). No host sync:
    masks by arithmetic, not boolean indexing."""
    B, Lt = ids.shape
    A = T.ANSWER_LEN
    dev = ids.device
    t = torch.rand(B, 1, device=dev, generator=generator)
    masked = (torch.rand(B, Lt, device=dev, generator=generator) < t) & sup
    one = F.one_hot(torch.randint(A, (B,), device=dev, generator=generator), A).bool()
    masked[:, -A:] |= one & ~masked[:, -A:].any(1, keepdim=True)   # at least one answer slot
    noisy = torch.where(masked, torch.full_like(ids, T.MASK), ids)
    with amp:
        logits = model(noisy, start)
    tgt, mk = ids[:, start:], masked[:, start:]
    ce_all = F.cross_entropy(logits.float().transpose(1, 2), tgt, reduction="none")
    return (ce_all * mk).sum() / mk.sum(), logits, mk, tgt


# ----------------------------------------------------------------------------- files

def save(model: LongLLaDA, out: Path, args, meta: dict) -> None:
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    out.mkdir(parents=True, exist_ok=True)
    save_file(model.published(), str(out / "model.safetensors"), metadata={"format": "pt"})
    ids = {k: VOCAB[f"<|{k}|>"] for k in ("bos", "eos", "mask", "eot")}
    cfg = {"model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": args.d,
           "n_layers": args.layers, "n_heads": args.heads, "n_kv_heads": args.heads,
           "mlp_hidden_size": args.ffn, "mlp_ratio": args.ffn / args.d, "vocab_size": len(VOCAB),
           "embedding_size": len(VOCAB), "rope_theta": args.rope_theta, "rope_full_precision": True,
           "rms_norm_eps": 1e-5, "max_sequence_length": max(T.LENGTHS) + T.ANSWER_LEN,
           "include_bias": False, "weight_tying": False, "activation_type": "silu",
           "block_type": "llama", "mask_token_id": ids["mask"], "eos_token_id": ids["eos"],
           "pad_token_id": ids["eos"], "bos_token_id": ids["bos"], "eot_token_id": ids["eot"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"max_new_tokens": T.ANSWER_LEN, "steps": T.ANSWER_LEN}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<|eot|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()   # decoding joins words with spaces
    tok.add_special_tokens(list(T.SPECIALS))
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "mask_token": "<|mask|>",
               "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
               "add_bos_token": True}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


# ----------------------------------------------------------------------------- main

def main():  # noqa: C901
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--rope-theta", type=float, default=500000.0)
    ap.add_argument("--lr", type=float, default=3e-4,
                    help="peak learning rate; 2e-3 wipes the structured initialisation out in ~100 steps")
    ap.add_argument("--init-offsets", default="1,2,3,4",
                    help="structured init: layer-0 head j attends to the token offsets[j] before (empty: "
                    "plain random init)")
    ap.add_argument("--init-match", type=int, default=1,
                    help="1: layer-1 head j matches on what layer-0 head j wrote (the induction hop)")
    ap.add_argument("--match-slow-pairs", type=int, default=16,
                    help="RoPE pairs (the slowest) the matching heads use; the slowest carries the mask penalty")
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--min-batch", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--stages", default="0.35:64:256,0.5:128:1024,0.65:512:4096,0.8:2048:8192,1.0:4096:16384",
                    help="latest_end:min_len:max_len,... (latest end as a fraction of the training "
                    "budget; a stage is left earlier once every task is learnt at its lengths)")
    ap.add_argument("--advance-acc", type=float, default=0.9,
                    help="leave a stage once every task's answer-character accuracy on masked "
                    "slots (running average) reaches this")
    ap.add_argument("--gate-tasks", default="kv,niah",
                    help="the tasks whose accuracy decides when to leave a stage (the retrieval "
                    "target comes first; copy keeps training alongside)")
    ap.add_argument("--min-stage-steps", type=int, default=100)
    ap.add_argument("--min-len", type=int, default=T.MIN_LENGTH, help="clip every stage's lengths")
    ap.add_argument("--max-len", type=int, default=max(T.LENGTHS))
    ap.add_argument("--tasks", default="kv,niah,copy")
    ap.add_argument("--queries", type=int, default=8,
                    help="kv/niah rows carry 1..queries queries, the earlier ones answered and "
                    "supervised (training only; held-out prompts have one)")
    ap.add_argument("--weights", default="0.5,0.25,0.25", help="sampling weight of each task")
    ap.add_argument("--time-budget-s", type=float, default=300.0, help="training wall-clock")
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many steps instead "
                    "(the curriculum then runs on the step count)")
    ap.add_argument("--workers", type=int, default=None, help="data processes (default: cores - 2, <= 12)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=250)
    ap.add_argument("--eval-n", type=int, default=100, help="held-out prompts per (task, length)")
    ap.add_argument("--eval-lengths", default=",".join(map(str, T.LENGTHS)))
    ap.add_argument("--eval-batch-tokens", type=int, default=262144)
    ap.add_argument("--deadline-s", type=float, default=570.0,
                    help="stop evaluating this long after start (results so far are kept)")
    args = ap.parse_args()

    tasks = tuple(args.tasks.split(","))
    weights = tuple(float(w) for w in args.weights.split(","))
    assert len(tasks) == len(weights) and all(t in T.TASKS for t in tasks)
    plan = stages(args)
    gate = [k for k in args.gate_tasks.split(",") if k in tasks] or list(tasks)
    t_ex = time.monotonic()
    for task in tasks:
        for L in T.LENGTHS:
            EXCLUDE.update(T.held_out_digests(task, L, args.eval_n))
    print(f"held-out digests: {len(EXCLUDE)} in {time.monotonic() - t_ex:.1f} s", flush=True)

    # the workers fork before CUDA is touched
    workers = args.workers if args.workers is not None else max(0, min(12, (os.cpu_count() or 2) - 2))
    pool = None
    if workers > 0:
        import multiprocessing as mp
        pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("fork"))
        pool.submit(int, 0).result()   # a fork pool starts all its workers at the first job

    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    model = LongLLaDA(len(VOCAB), args.d, args.layers, args.heads, args.ffn, args.rope_theta).to(dev)
    if args.init_offsets:
        offsets = tuple(int(o) for o in args.init_offsets.split(","))
        info = init_offset_heads(model, offsets, span=args.max_len + max(map(abs, offsets)) + 16)
        if args.init_match and args.layers > 1:
            init_match_heads(model, 1, info["out"], info["u"], args.match_slow_pairs)
        print(f"structured init: layer-0 offset heads {offsets}"
              + (", layer-1 matching heads" if args.init_match and args.layers > 1 else ""), flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "emb" not in n)
    print(f"model: d={args.d} layers={args.layers} heads={args.heads} ffn={args.ffn} "
          f"theta={args.rope_theta:g}: {n_params / 1e6:.2f} M parameters, "
          f"{n_params * 2 / 2**20:.1f} MiB in bf16; {workers} data workers", flush=True)

    def batch_for(L: int) -> int:
        return min(args.max_batch, max(args.min_batch, args.tokens_per_step // L))

    for i, (end, lo, hi) in enumerate(plan):
        est = [f"L={L} B={batch_for(L)} "
               f"{train_flops(matmul_params, args.d, args.layers, batch_for(L), L + T.ANSWER_LEN) / 1e12:.2f}"
               for L in (lo, hi)]
        print(f"  stage {i} (until {end:.2f} at the latest): " + ", ".join(est) + " TFLOP/step", flush=True)
    fused = {"fused": True} if dev.type == "cuda" else {}
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), **fused)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")

    rng = random.Random(args.seed)
    t0 = time.monotonic()

    def progress(step: int) -> float:
        if args.max_steps is not None:
            return step / args.max_steps
        return (time.monotonic() - t0) / args.time_budget_s

    state = {"stage": 0}

    def job():
        _, lo, hi = plan[state["stage"]]
        L = pick_length(rng, lo, hi)
        return (rng.getrandbits(62), L, batch_for(L), tasks, weights, args.queries)

    queue: collections.deque = collections.deque()

    def next_batch():
        if pool is None:
            return make_batch(*job())
        while len(queue) < 2 * workers:
            queue.append(pool.submit(make_batch, *job()))
        return queue.popleft().result()

    def change_stage(new: int, why: str):
        save(model, args.out, args, {"checkpoint": f"end of stage {state['stage']}", "steps": step})
        transitions.append({"step": step, "t": round(time.monotonic() - t0, 1), "to": new, "why": why,
                            "acc": {k: round(v, 3) for k, v in ema.items()}})
        print(f"stage {state['stage']} -> {new} at step {step} ({why}); checkpoint saved", flush=True)
        state["stage"] = new
        ema.clear()
        stage_steps[new] = 0
        queue.clear()  # batches of the old stage are dropped (their futures just finish)

    log, transitions, stage_steps = [], [], collections.Counter()
    ema: dict[str, float] = {}
    seen_tokens, step, flops = 0, 0, 0.0
    last_t, last_step = time.monotonic(), 0
    while True:
        f = progress(step)
        if f >= 1.0:
            break
        st = state["stage"]
        if st + 1 < len(plan):
            learnt = (all(ema.get(k, 0.0) >= args.advance_acc for k in gate)
                      and stage_steps[st] >= args.min_stage_steps)
            if learnt or f >= plan[st][0]:
                change_stage(st + 1, "learnt" if learnt else "time")
                continue
        arr, sup_np, kinds = next_batch()
        start = int(np.argmax(sup_np.any(0)))          # the first supervised column of the batch
        ids, sup, kinds = (torch.from_numpy(x) for x in (arr, sup_np, kinds))
        if dev.type == "cuda":
            ids, sup = (x.pin_memory().to(dev, non_blocking=True) for x in (ids, sup))
            kinds = kinds.to(dev, non_blocking=True)
        B, Lt = ids.shape
        plen = Lt - T.ANSWER_LEN
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.55 + 0.45 * math.cos(math.pi * min(f, 1.0)))
        for g in opt.param_groups:
            g["lr"] = lr
        ce, logits, masked, tgt = masked_loss(model, ids, sup, start, amp)
        opt.zero_grad(set_to_none=True)
        ce.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        stage_steps[st] += 1
        seen_tokens += B * Lt
        flops += train_flops(matmul_params, args.d, args.layers, B, Lt)
        if step % 10 == 0:  # per-task accuracy on the masked answer words of the asked query
            with torch.no_grad():
                A = T.ANSWER_LEN
                words = masked[:, -A:] & (tgt[:, -A:] != T.EOS)
                hit = (logits[:, -A:].argmax(-1) == tgt[:, -A:]) & words
                onek = F.one_hot(kinds, len(tasks)).T.float()                 # [tasks, B]
                acc = torch.stack([onek @ hit.sum(1).float(), onek @ words.sum(1).float()]).tolist()
            for k, (h, c) in enumerate(zip(*acc)):
                if c > 0:
                    a = h / c
                    ema[tasks[k]] = a if tasks[k] not in ema else 0.8 * ema[tasks[k]] + 0.2 * a
        if step % args.log_every == 0 or step == 1:
            now = time.monotonic()
            rec = {"step": step, "t": round(now - t0, 1), "stage": st, "L": plen, "B": B,
                   "loss": round(ce.item(), 4), "acc": {k: round(v, 3) for k, v in ema.items()}, "lr": lr}
            log.append(rec)
            ms = (now - last_t) / max(1, step - last_step) * 1e3
            last_t, last_step = now, step
            print(f"step {step:>6} {rec['t']:>6.1f}s stage {st} L={plen:>5} B={B:>4} loss {rec['loss']:.4f} "
                  f"acc {' '.join(f'{k}={v:.2f}' for k, v in rec['acc'].items())} lr {lr:.1e} "
                  f"{ms:.0f} ms/step {flops / max(now - t0, 1e-9) / 1e12:.0f} TFLOP/s", flush=True)
    train_s = time.monotonic() - t0
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
    meta = {"arch": "llada", "d_model": args.d, "layers": args.layers, "heads": args.heads,
            "ffn": args.ffn, "rope_theta": args.rope_theta, "parameters": n_params,
            "tasks": dict(zip(tasks, weights)), "stages": plan, "advance_acc": args.advance_acc, "gate_tasks": gate,
            "transitions": transitions, "steps": step, "steps_per_stage": dict(stage_steps),
            "train_seconds": round(train_s, 1), "tokens_seen": seen_tokens, "train_flops_est": flops,
            "lr": args.lr, "tokens_per_step": args.tokens_per_step, "seed": args.seed, "device": str(dev),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "torch": torch.__version__, "held_out_excluded": len(EXCLUDE),
            "init_offsets": args.init_offsets, "init_match": args.init_match,
            "objective": "masked diffusion SFT: answer tokens masked with p=t~U(0,1), mean CE over masked",
            "log": log}
    save(model, args.out, args, meta)
    print(f"trained {step} steps in {train_s:.0f} s ({seen_tokens / 1e6:.0f} M tokens, "
          f"~{flops / 1e15:.1f} PFLOP); saved {args.out}", flush=True)

    # ------------------------------------------------------------ held-out, through the engine
    model = opt = logits = ce = masked = tgt = None  # free the training memory before the engine loads
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    from mosaic import MosaicEngine
    engine = MosaicEngine(str(args.out), {"device": args.device, "progress": False})
    lengths = [int(x) for x in args.eval_lengths.split(",")]
    path = args.out / "long_accuracy.json"
    header = {"model": str(args.out.name), "engine": "MosaicEngine, planned path (dense)",
              "device": str(dev), "gpu": meta["gpu"], "train_seconds": meta["train_seconds"], "steps": step}

    def write(res):
        path.write_text(json.dumps(header | res, indent=2) + "\n")

    t_eval = time.monotonic()
    res = T.evaluate(engine, tasks, lengths, args.eval_n, args.eval_batch_tokens,
                     deadline=T_START + args.deadline_s, on_cell=write)
    res["eval_seconds"] = round(time.monotonic() - t_eval, 1)
    write(res)
    meta["held_out_exact"] = {f"{c['task']}@{c['length']}": c["exact"] for c in res["cells"]}
    (args.out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"evaluation: {res['eval_seconds']} s -> {path}")
    print(T.table(res), flush=True)


if __name__ == "__main__":
    main()
