"""Fused mask-only LM head + sampling reduction (Triton).

Grid (row blocks, vocabulary splits). Each program gathers its BM masked rows of the final
hidden state through the row list (int64 offsets, no gathered copy), multiplies them by BN-wide
tiles of the LM head with fp32 accumulation, rounds each logit to the model dtype (as the
reference's logits are), and folds every tile into per-row running state:

  m1, idx1   max logit and its id (ties keep the lowest id, as torch.argmax)
  s          sum exp(l - m1), rescaled when m1 grows (online softmax)
  m2         second-largest logit (top-2 margin)
  t          sum exp(l - m1) * (l - m1)   (entropy: sum p log p = t / s - log s)
  g, lg, ig  best Gumbel score l - T log(-log u), the logit there, and its id

Splits write their state to a small workspace [S, M, 8] (fp32), combined afterwards; only O(M)
bytes besides the [M] outputs. The uniform u comes from Philox keyed on (seed, position * V +
token): a counter-based stream, not torch's. The seed is read from a device tensor [1] int64
(SEED), so a captured step draws from the seed its replay wrote there (graph/ctx.py draws it
from the request's generator inside the step).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import interpret

NUM_FIELDS = 8
NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": keeps 0 * (-inf) NaNs out of running sums
TARGET_PROGRAMS = 264  # two waves on a 132-SM H200


def num_splits(m: int, block_m: int = 64) -> int:
    """Vocabulary splits so that small M still fills the GPU; a pure function of M."""
    return max(1, min(16, math.ceil(TARGET_PROGRAMS / max(1, math.ceil(m / block_m)))))


def workspace_shape(m: int) -> tuple[int, int, int]:
    return (num_splits(m), m, NUM_FIELDS)


@triton.jit
def _kernel(X, ROWS, POS, W, WS, M, V, D, stride_x, stride_w, split_width, SEED, temperature,
            GUMBEL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    rows = tl.load(ROWS + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_k = tl.arange(0, BK)
    m1 = tl.full((BM,), NEG, tl.float32)
    m2 = tl.full((BM,), NEG, tl.float32)
    s = tl.zeros((BM,), tl.float32)
    t = tl.zeros((BM,), tl.float32)
    idx1 = tl.zeros((BM,), tl.int32)
    g = tl.full((BM,), NEG, tl.float32)
    lg = tl.full((BM,), NEG, tl.float32)
    ig = tl.zeros((BM,), tl.int32)
    if GUMBEL:
        pos = tl.load(POS + offs_m, mask=mask_m, other=0).to(tl.int64)
        seed = tl.load(SEED)
    n_start = pid_s * split_width          # a multiple of every config's BN
    n_end = tl.minimum(V, n_start + split_width)
    for n0 in range(n_start, n_end, BN):
        offs_n = n0 + tl.arange(0, BN)
        mask_n = offs_n < V
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, D, BK):
            kk = k0 + offs_k
            a = tl.load(X + rows[:, None] * stride_x + kk[None, :],
                        mask=mask_m[:, None] & (kk[None, :] < D), other=0.0)
            b = tl.load(W + offs_n.to(tl.int64)[:, None] * stride_w + kk[None, :],
                        mask=mask_n[:, None] & (kk[None, :] < D), other=0.0)
            if IEEE:
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        acc = acc.to(X.dtype.element_ty).to(tl.float32)        # logits in the model dtype
        acc = tl.where(mask_n[None, :], acc, NEG)
        tmax = tl.max(acc, axis=1)
        targ = tl.argmax(acc, axis=1, tie_break_left=True) + n0
        tm2 = tl.max(tl.where(offs_n[None, :] == targ[:, None], NEG, acc), axis=1)
        new_m = tl.maximum(m1, tmax)
        alpha = tl.exp(m1 - new_m)
        e = tl.exp(acc - new_m[:, None])
        e = tl.where(mask_n[None, :], e, 0.0)
        t = alpha * (t + (m1 - new_m) * s) + tl.sum(e * (acc - new_m[:, None]), axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        m2 = tl.maximum(tl.minimum(m1, tmax), tl.maximum(m2, tm2))
        idx1 = tl.where(tmax > m1, targ, idx1)
        m1 = new_m
        if GUMBEL:
            u = tl.rand(seed, pos[:, None] * V + offs_n[None, :].to(tl.int64))
            gs = acc - temperature * tl.log(-tl.log(u))
            gs = tl.where(mask_n[None, :], gs, NEG)
            gmax = tl.max(gs, axis=1)
            garg = tl.argmax(gs, axis=1, tie_break_left=True) + n0
            gl = tl.sum(tl.where(offs_n[None, :] == garg[:, None], acc, 0.0), axis=1)
            better = gmax > g
            lg = tl.where(better, gl, lg)
            ig = tl.where(better, garg, ig)
            g = tl.where(better, gmax, g)
    base = WS + (pid_s * M + offs_m).to(tl.int64) * 8
    tl.store(base + 0, m1, mask=mask_m)
    tl.store(base + 1, s, mask=mask_m)
    tl.store(base + 2, idx1.to(tl.float32), mask=mask_m)
    tl.store(base + 3, m2, mask=mask_m)
    tl.store(base + 4, t, mask=mask_m)
    tl.store(base + 5, g, mask=mask_m)
    tl.store(base + 6, lg, mask=mask_m)
    tl.store(base + 7, ig.to(tl.float32), mask=mask_m)


_CONFIGS = [triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=st)
            for bm, bn, bk, w, st in [(64, 128, 64, 4, 4), (64, 256, 64, 8, 3), (128, 128, 64, 8, 3),
                                      (128, 256, 64, 8, 3), (64, 128, 128, 4, 3)]]
# keyed on the hidden size only: the masked count changes every step and must never recompile
_tuned = triton.autotune(configs=_CONFIGS, key=["D"])(_kernel)


def launch(x, rows, positions, w, ws, spec, fixed: bool = False, seed: torch.Tensor | None = None) -> None:
    """fixed: one tile (the first config), never the autotuner's pick (batch-invariant mode).
    seed: [1] int64 on x's device, the Gumbel stream's key (None: spec.seed, a new tensor)."""
    M, D = rows.shape[0], x.shape[1]
    V, S = w.shape[0], ws.shape[0]
    if seed is None:
        seed = torch.full((1,), spec.seed, dtype=torch.int64, device=x.device)
    kw = dict(SEED=seed, temperature=float(spec.temperature), GUMBEL=spec.temperature > 0,
              IEEE=x.dtype == torch.float32)
    tuned = not interpret() and x.device.type == "cuda"
    unit = 256 if tuned else 16
    split_width = math.ceil(math.ceil(V / unit) / S) * unit
    args = (x, rows, positions, w, ws, M, V, D, x.stride(0), w.stride(0), split_width)
    if tuned and fixed:
        c = _CONFIGS[0]
        _kernel[(triton.cdiv(M, c.kwargs["BM"]), S)](*args, **c.kwargs, num_warps=c.num_warps,
                                                    num_stages=c.num_stages, **kw)
    elif tuned:
        _tuned[lambda meta: (triton.cdiv(M, meta["BM"]), S)](*args, **kw)
    else:  # the interpreter: one small config, no tuning runs
        _kernel[(triton.cdiv(M, 16), S)](*args, BM=16, BN=16, BK=16, **kw)


def _sum0(t: torch.Tensor, fixed_order: bool) -> torch.Tensor:
    """t [S, M] summed over the splits: torch's sum (its order is PyTorch's choice for the
    shape), or split 0 + split 1 + ... in that order (elementwise adds: the same for any M)."""
    if not fixed_order:
        return t.sum(0)
    acc = t[0].clone()
    for i in range(1, t.shape[0]):
        acc += t[i]
    return acc


def combine(ws: torch.Tensor, spec, outs: dict, fixed_order: bool = False) -> None:
    """Fold the splits' states [S, M, 8] into the outputs (small O(S*M) tensors); fixed_order:
    sums over the splits in split order (batch-invariant mode)."""
    m1, s, idx1, m2, t = ws[..., 0], ws[..., 1], ws[..., 2], ws[..., 3], ws[..., 4]
    M1 = m1.max(0).values                                             # [M]
    scale = torch.exp(m1 - M1)                                        # [S, M]
    S_tot = _sum0(s * scale, fixed_order)
    first = torch.argmax((m1 == M1).to(torch.uint8), 0)              # lowest split holding the max
    x0 = idx1.gather(0, first[None])[0]
    conf_logit = M1
    if spec.temperature > 0:
        g = ws[..., 5]
        gbest = torch.argmax((g == g.max(0).values).to(torch.uint8), 0)
        x0 = ws[..., 7].gather(0, gbest[None])[0]
        conf_logit = ws[..., 6].gather(0, gbest[None])[0]
    outs["x0"].copy_(x0.to(torch.int64))
    if "conf" in outs:
        if spec.want_margin:
            top2 = torch.cat([m1, m2]).topk(2, dim=0).values              # [2, M]
            conf = (1 - torch.exp(top2[1] - top2[0])) / S_tot
        elif spec.want_entropy:
            T = _sum0(scale * (t + (m1 - M1) * s), fixed_order)
            conf = T / S_tot - torch.log(S_tot)
        else:
            conf = torch.exp(conf_logit - M1) / S_tot
        outs["conf"].copy_(conf)


@triton.jit
def _uniform_kernel(OUT, POS, V, SEED, BN: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BN + tl.arange(0, BN)
    pos = tl.load(POS + r).to(tl.int64)
    u = tl.rand(tl.load(SEED), pos * V + offs.to(tl.int64))
    tl.store(OUT + r.to(tl.int64) * V + offs, u, mask=offs < V)


def uniform(seed, positions: torch.Tensor, V: int) -> torch.Tensor:
    """The kernel's Gumbel stream as a [m, V] tensor (for tests and the oracle); seed: an int
    or a [1] int64 tensor on positions' device."""
    out = torch.empty(positions.shape[0], V, dtype=torch.float32, device=positions.device)
    if not isinstance(seed, torch.Tensor):
        seed = torch.full((1,), seed, dtype=torch.int64, device=positions.device)
    _uniform_kernel[(positions.shape[0], triton.cdiv(V, 64))](out, positions, V, seed, BN=64)
    return out
