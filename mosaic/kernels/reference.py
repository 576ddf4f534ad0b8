"""PyTorch versions of every op, writing into given buffers: the CPU path and the test oracle.

Each op reproduces the published numerics bit for bit when given the same inputs (same op order,
same dtypes, same rounding points). fp32 intermediates go to caller-given scratch of at most
ROW_TILE rows, so an op over N rows never allocates N-sized temporaries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 4096  # rows per scratch tile: 4096 x 4096 fp32 x 2 tiles = 128 MiB for LLaDA-8B


def row_tiles(n: int, tile: int = ROW_TILE):
    for s in range(0, n, tile):
        yield s, min(n, s + tile)


def rmsnorm(out, x, w, eps, s1, s2, mean=None):
    """out = bf16(x * rsqrt(mean(x^2) + eps)) * w, as LLaDA / Qwen2 (fp32 inside).

    x, out: [n, d]; s1, s2: fp32 scratch [>= min(n, ROW_TILE), d]. out may alias x. mean(out
    [r, 1], sq [r, d]): another row mean (batch-invariant mode)."""
    for a, b in row_tiles(x.shape[0], s1.shape[0]):
        t, sq = s1[: b - a], s2[: b - a]
        t.copy_(x[a:b])
        torch.pow(t, 2, out=sq)
        if mean is None:
            var = sq.mean(-1, keepdim=True)        # [rows, 1]
        else:
            var = torch.empty(b - a, 1, dtype=sq.dtype, device=sq.device)
            mean(var, sq)
        t.mul_(torch.rsqrt(var.add_(eps)))
        out[a:b].copy_(t)
        out[a:b].mul_(w)


def rmsnorm_one_pass(out, x, w, eps, block: int = 1024, add=None):
    """The one-pass kernel's math (kernels/rmsnorm_triton.py) in PyTorch, the test oracle: x +=
    add (in place, rounded to x's dtype), each row's fp32 squares summed block by block of
    `block` columns in order (inside a block PyTorch's sum, not tl.sum's tree: equal to the
    kernel within fp32 rounding), out = (x * rsqrt(sum / d + eps)).to(out.dtype) * w. x, out
    [n, d], w [d]; allocates fp32 temporaries [n, d] (an oracle, never a planned op)."""
    if add is not None:
        x.add_(add)
    f = x.float()
    acc = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    for c in range(0, x.shape[1], block):
        acc += f[:, c:c + block].square().sum(-1)
    out.copy_(f * torch.rsqrt(acc / x.shape[1] + eps)[:, None])
    out.mul_(w)


def linear(out, x, w, b=None):
    # F.linear dispatches to addmm with a bias (one rounding) and to mm without one
    if b is None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.addmm(b, x, w.t(), out=out)


def rope_cos_sin(cos, sin, positions, inv_freq):
    """cos/sin: [n, rot/2] fp32 scratch; positions: [n] int64; freqs = pos * inv_freq in fp32."""
    torch.mul(positions.to(torch.float32)[:, None], inv_freq[None, :], out=cos)
    torch.sin(cos, out=sin)
    cos.cos_()


def rope_(t, positions, inv_freq, fp32, s1, s2, c, s, cos_sin=None):
    """Rotate-half RoPE in place on t [n, H, hd] over the first rot = 2*len(inv_freq) dims.

    fp32=True (LLaDA): applied in fp32 on fp32 cos/sin, cast back once. fp32=False (Dream,
    HF style): cos/sin cast to t's dtype and every product and sum rounds to that dtype.
    s1, s2: scratch [>= tile, H, rot/2] in the compute dtype; c, s: [>= tile, rot/2] fp32.
    cos_sin: the function filling c, s (default rope_cos_sin; batch-invariant mode passes
    kernels/invariant.rope_cos_sin)."""
    cos_sin = cos_sin or rope_cos_sin
    for a, b in row_tiles(t.shape[0], s1.shape[0]):
        n = b - a
        cc, ss = c[:n], s[:n]
        cos_sin(cc, ss, positions[a:b], inv_freq)
        _rotate(t[a:b], cc, ss, fp32, s1[:n], s2[:n])


def rope_tabled_(t, c, s, fp32, s1, s2):
    """rope_ with the cos / sin of t's rows already in c, s [n, rot/2] fp32 (one table per step,
    computed once for every layer: rope_cos_sin over the step's positions); s1, s2 as rope_'s."""
    for a, b in row_tiles(t.shape[0], s1.shape[0]):
        n = b - a
        _rotate(t[a:b], c[a:b], s[a:b], fp32, s1[:n, :t.shape[1]], s2[:n, :t.shape[1]])


def _rotate(t, cc, ss, fp32, A, B):
    """t [n, H, hd] rotated in place by cos / sin cc, ss [n, rot/2] fp32; A, B scratch [n, H, rot/2]."""
    half = cc.shape[1]
    if not fp32:
        cc, ss = cc.to(t.dtype), ss.to(t.dtype)
    cc, ss = cc[:, None, :], ss[:, None, :]
    x1, x2 = t[:, :, :half], t[:, :, half: 2 * half]
    # first half: x1*cos + (-x2)*sin ; second half: x2*cos + x1*sin (same rounding points)
    torch.mul(x1, cc, out=A)
    torch.mul(x2, ss, out=B)
    A.sub_(B)
    torch.mul(x1, ss, out=B)
    x1.copy_(A)
    torch.mul(x2, cc, out=A)
    A.add_(B)
    x2.copy_(A)


def attention(out, q, k, v, cudnn: bool = False, own: bool = False):
    """Bidirectional attention. q [nq, Hq, hd]; k, v [Nk, Hkv, hd]; out [nq, Hq*hd]. Returns
    the result: out, or with own=True SDPA's own output as an [nq, Hq*hd] view where its layout
    already is that (multi-head attention with flash's [B, nq, H, hd] output: no copy).

    Grouped-query attention runs as plain multi-head attention over Hkv heads whose query rows
    are the G = Hq/Hkv query heads of each group stacked (G*nq rows): exact, and K/V are never
    expanded, whatever SDPA backend runs. SDPA allocates its output (and, with G > 1, the
    regrouped q) outside the plan: the ctx charges both as external bytes of this op."""
    qq, hkv, g = _stack_groups(q, k.shape[1])
    kk, vv = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if cudnn:  # cuDNN first; SDPA falls through to flash when cuDNN declines the inputs
        from torch.nn.attention import SDPBackend, sdpa_kernel
        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        with sdpa_kernel(order, set_priority=True):  # cuDNN declines a strided q: copy it
            o = F.scaled_dot_product_attention(qq.contiguous(), kk, vv)
    else:
        o = F.scaled_dot_product_attention(qq, kk, vv)
    res = _unstack_groups(o, q.shape[0], hkv, g)
    if own and res.is_contiguous():
        return res.view(out.shape)
    out.view(q.shape[0], hkv, g, q.shape[2]).copy_(res)
    return out


def _stack_groups(q, hkv):
    """q [nq, Hq, hd] -> [1, Hkv, G*nq, hd]: each group's G query heads as extra query rows."""
    nq, hq, hd = q.shape
    g = hq // hkv
    return q.view(nq, hkv, g, hd).permute(1, 2, 0, 3).reshape(1, hkv, g * nq, hd), hkv, g


def _unstack_groups(o, nq, hkv, g):
    """[1, Hkv, G*nq, hd] -> [nq, Hkv, G, hd] (a view)."""
    return o[0].view(hkv, g, nq, o.shape[-1]).permute(2, 0, 1, 3)


def silu_mul_(g, u):
    F.silu(g, inplace=True)
    g.mul_(u)


def embed(out, ids, weight):
    torch.index_select(weight, 0, ids, out=out)


def gather_rows(out, x, rows):
    torch.index_select(x, 0, rows, out=out)


def attention_partial(q, k, v, native: bool = False):
    """Attention of q [nq, Hq, hd] against one block of keys: (o [nq, Hq, hd], lse fp32 [Hq, nq])
    so that blocks can be merged exactly in log-sum-exp form (sequence parallelism). o is fp32,
    or with native=True a view of the kernel's own output in q's dtype (no copy). Grouped-query
    heads are stacked as in attention(). Allocates outside any plan: the kernel's output
    (nq x Hq x hd in q's dtype), its lse and, with grouped heads, the regrouped q
    (partial_bytes)."""
    nq, hq, hd = q.shape
    qq, hkv, g = _stack_groups(q, k.shape[1])
    kk, vv = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if q.device.type == "cuda":
        res = _partial_cuda(qq, kk, vv)
        lse = res[1]   # flash/efficient: [1, Hkv, >= g*nq]; cuDNN: [1, Hkv, g*nq, 1]
        o, lse = res[0], lse.reshape(lse.shape[0], lse.shape[1], -1)[..., : g * nq]
    else:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qq, kk, vv)
    o = _unstack_groups(o, nq, hkv, g).reshape(nq, hq, hd)
    return (o if native else o.float()), lse[0].reshape(hkv, g, nq).reshape(hq, nq).float()


PARTIAL_BACKENDS = ["cudnn", "flash", "efficient"]   # tried in this order; tests may reorder


def _partial_cuda(qq, kk, vv):
    """SDPA with its log-sum-exp on [1, H, n, hd] tensors: the first of PARTIAL_BACKENDS that
    takes the shape. cuDNN's fused kernel runs ~600 TFLOP/s on an H200 at these shapes against
    ~350 for flash (gpu/bench_attention.json); efficient takes fp32 inputs."""
    err = None
    # cuDNN's and flash's fused kernels are 16-bit only; float32 goes to the memory-efficient
    # kernel directly. Trying cuDNN first in float32 gave NaN on the H200 instead of an error
    # (tests/gpu/test_gpu.py's fp32 merge and the two-ranks-on-one-GPU tokens, which run float32:
    # bench/results/gpu/everyday/gpu_tests_b8ea6f4.log)
    names = PARTIAL_BACKENDS if qq.dtype in (torch.float16, torch.bfloat16) else ["efficient"]
    for name in names:
        try:
            if name == "cudnn":
                return torch.ops.aten._scaled_dot_product_cudnn_attention(qq, kk, vv, None, True, 0.0, False, False)
            if name == "flash":
                return torch.ops.aten._scaled_dot_product_flash_attention(qq, kk, vv, 0.0, False, False)
            return torch.ops.aten._scaled_dot_product_efficient_attention(qq, kk, vv, None, True)
        except (RuntimeError, NotImplementedError) as e:
            err = e
    raise err


def partial_bytes(nq: int, hq: int, hkv: int, hd: int, itemsize: int) -> int:
    """Bytes attention_partial(native=True) + merge_partial allocate at once: the kernel's output,
    the regrouped q with grouped heads, and five [Hq, nq] fp32 vectors (the kernel's lse, the
    merged lse and the two rescaling factors, one temporary)."""
    return (2 if hq != hkv else 1) * nq * hq * hd * itemsize + 5 * hq * nq * 4


def merge_partial(acc_o, acc_lse, o, lse):
    """Fold one block's (o, lse) into running (acc_o [nq, H, hd] fp32, acc_lse [H, nq]), in
    place: acc_o = acc_o * exp(acc_lse - new) + o * exp(lse - new), new = logaddexp(acc_lse, lse).
    o may be in a lower precision (a kernel's native output): it is widened inside addcmul, so
    no fp32 copy of it is made."""
    new = torch.logaddexp(acc_lse, lse)
    acc_o.mul_(torch.exp(acc_lse - new).t()[:, :, None])
    acc_o.addcmul_(o, torch.exp(lse - new).t()[:, :, None])
    acc_lse.copy_(new)
