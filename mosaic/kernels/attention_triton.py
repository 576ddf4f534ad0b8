"""Bidirectional attention forward in Triton: FlashAttention-2 (Dao 2023), dense or block-sparse,
with flash-decoding split-K for short query chunks against long keys.

Grid (cdiv(nq, BLOCK_M), Hq, S). A program holds BLOCK_M query rows of one head in registers
and walks its share of the key tiles (BLOCK_N keys each) with the online softmax: running row
max m and sum l in the exp2 domain (scores * scale * log2 e), fp32 accumulator rescaled by
exp2(m_old - m_new). Tile t of a program's list starts at key

    dense:   t * BLOCK_N
    sparse:  indices[e0 + t // R] * LAYOUT_BK + (t % R) * BLOCK_N,   R = LAYOUT_BK / BLOCK_N

so both modes are one loop; split s of S takes tiles [s * ceil(T/S), (s+1) * ceil(T/S)). Only the
last tile of a list can reach past Nk (dense: by construction; sparse: indices ascend, and the
tiles of the last layout block wholly past Nk are dropped from T), so every tile but the last
runs without masks. The running max starts at a finite -1e30 and masked
scores are -inf, so a row that sees no key keeps l = 0 and ends with out = 0, lse = -inf.

S = 1 writes out (model dtype) and lse directly; S > 1 writes each split's normalised output and
lse (fp32) to the workspace, and _combine merges them: lse = logsumexp_s lse_s, out = sum_s
exp(lse_s - lse) o_s. All row offsets are int64; per-tile offsets are int32 from a 64-bit base.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import interpret
from .attention_split import num_splits, split_workspace_elems

# K/V through TMA descriptors by default (Hopper+, triton >= 3.4): off until `python -m bench attention`
# shows it faster on the H200; attention_into(tma=True) turns it on per call (the bench's rows do)
TMA_DEFAULT = False

NEG = tl.constexpr(-1.0e30)   # finite start of the running max: exp2(NEG - NEG) = 1, not NaN
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _mm(a, b, acc, IEEE: tl.constexpr):
    if IEEE:   # fp32 inputs, or the interpreter (its dot multiplies bf16's raw uint16 bits): exact fp32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _kv_tile(X, desc, row0, col0, stride_n, N, offs_n, offs_d,
             MASK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """[BLOCK_N, BLOCK_D] keys or values from row row0 (int64), columns col0 .. col0 + HEAD_DIM."""
    if TMA:
        return desc.load([row0.to(tl.int32), col0])   # rows past N read as zeros (masked by the caller)
    else:
        ptrs = X + row0 * stride_n + col0 + offs_n[:, None] * stride_n + offs_d[None, :]
        if MASK_N:
            return tl.load(ptrs, mask=(offs_n[:, None] < N - row0) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        elif BLOCK_D != HEAD_DIM:
            return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _step(acc, l_i, m_i, q, K, V, desc_k, desc_v, start_n, k_col, v_col, stride_kn, stride_vn, Nk,
          offs_n, offs_d, qk_scale,
          MASK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr,
          IEEE: tl.constexpr):
    """One key tile folded into the running (acc, l, m): FlashAttention-2's inner loop body."""
    k = _kv_tile(K, desc_k, start_n, k_col, stride_kn, Nk, offs_n, offs_d, MASK_N, HEAD_DIM, BLOCK_D, TMA)
    qk = _mm(q, tl.trans(k), None, IEEE)
    if MASK_N:
        qk = tl.where((start_n + offs_n < Nk)[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _kv_tile(V, desc_v, start_n, v_col, stride_vn, Nk, offs_n, offs_d, MASK_N, HEAD_DIM, BLOCK_D, TMA)
    acc = _mm(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
    return acc, l_i, m_new


@triton.jit
def _tile_start(t, Indices, e0, LAYOUT_BK: tl.constexpr, BLOCK_N: tl.constexpr):
    if LAYOUT_BK > 0:
        R: tl.constexpr = LAYOUT_BK // BLOCK_N
        j = tl.load(Indices + e0 + t // R).to(tl.int64)
        return j * LAYOUT_BK + (t % R) * BLOCK_N
    else:
        return e0 + t * BLOCK_N      # e0 = 0 as int64: the key index widens before any stride product


@triton.jit(do_not_specialize=["nq", "Nk", "splits"])   # lengths change every call: one compile
def _attn_fwd(Q, K, V, Out, Lse, WsO, WsL, Indptr, Indices, desc_k, desc_v,
              nq, Nk, Hq, sm_scale, splits,
              stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
              stride_om, stride_oh, stride_lh, stride_ip,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, G: tl.constexpr,
              LAYOUT_BQ: tl.constexpr, LAYOUT_BK: tl.constexpr, LAYOUT_DIV: tl.constexpr,
              WRITE_LSE: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr, IEEE: tl.constexpr,
              WS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    kvh = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < nq
    q_ptrs = Q + offs_m.to(tl.int64)[:, None] * stride_qm + h * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)

    # this program's tile list: [t0, t1) of T tiles
    e0 = tl.full((), 0, tl.int64)
    if LAYOUT_BQ > 0:
        lrow = (pid_m * BLOCK_M) // LAYOUT_BQ
        ip = Indptr + (h // LAYOUT_DIV) * stride_ip + lrow
        e0 = tl.load(ip).to(tl.int64)
        e1 = tl.load(ip + 1).to(tl.int64)
        # the last layout block may end past Nk by several kernel tiles: drop those wholly past it
        j_last = tl.load(Indices + tl.maximum(e1 - 1, 0), mask=e1 > e0, other=0).to(tl.int64)
        tail = tl.minimum(tl.maximum(tl.cdiv(Nk - j_last * LAYOUT_BK, BLOCK_N), 0), LAYOUT_BK // BLOCK_N)
        total = tl.where(e1 > e0, (e1 - e0 - 1) * (LAYOUT_BK // BLOCK_N) + tail, 0)
    else:
        total = tl.cdiv(Nk, BLOCK_N)
    per = tl.cdiv(total, splits)
    t0 = s * per
    t1 = tl.minimum(total, t0 + per)

    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full((BLOCK_M,), NEG, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    k_col = kvh * stride_kh
    v_col = kvh * stride_vh
    for t in tl.range(t0, t1 - 1, warp_specialize=WS):
        start_n = _tile_start(t, Indices, e0, LAYOUT_BK, BLOCK_N)
        acc, l_i, m_i = _step(acc, l_i, m_i, q, K, V, desc_k, desc_v, start_n, k_col, v_col, stride_kn,
                              stride_vn, Nk, offs_n, offs_d, qk_scale, False, HEAD_DIM, BLOCK_D, TMA, IEEE)
    if t1 > t0:
        start_n = _tile_start(t1 - 1, Indices, e0, LAYOUT_BK, BLOCK_N)
        acc, l_i, m_i = _step(acc, l_i, m_i, q, K, V, desc_k, desc_v, start_n, k_col, v_col, stride_kn,
                              stride_vn, Nk, offs_n, offs_d, qk_scale, True, HEAD_DIM, BLOCK_D, TMA, IEEE)

    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    d_ok = offs_d[None, :] < HEAD_DIM
    if SPLIT:
        row = (s * Hq + h).to(tl.int64) * nq + offs_m
        tl.store(WsO + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None] & d_ok)
        tl.store(WsL + row, lse, mask=row_ok)
    else:
        o_ptrs = Out + offs_m.to(tl.int64)[:, None] * stride_om + h * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok)
        if WRITE_LSE:
            tl.store(Lse + h.to(tl.int64) * stride_lh + offs_m, lse, mask=row_ok)


@triton.jit
def _combine(WsO, WsL, Out, Lse, nq, Hq, splits, stride_om, stride_oh, stride_lh,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr, BLOCK_M: tl.constexpr):
    """Merge S normalised partials in log-sum-exp form (flash-decoding's reduction)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < nq
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    for s in range(splits):
        m = tl.maximum(m, tl.load(WsL + (s * Hq + h).to(tl.int64) * nq + offs_m, mask=row_ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for s in range(splits):
        row = (s * Hq + h).to(tl.int64) * nq + offs_m
        w = tl.exp(tl.load(WsL + row, mask=row_ok, other=float("-inf")) - m_safe)   # 0 for empty splits
        den += w
        acc += w[:, None] * tl.load(WsO + row[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    seen = den > 0
    den = tl.where(seen, den, 1.0)
    out = acc / den[:, None]
    o_ptrs = Out + offs_m.to(tl.int64)[:, None] * stride_om + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask)
    if WRITE_LSE:
        tl.store(Lse + h.to(tl.int64) * stride_lh + offs_m, tl.where(seen, m_safe + tl.log(den), float("-inf")),
                 mask=row_ok)


# Hopper, hd 128 bf16 (tools/attention_compile_check.py): 128 query rows x 64-128 keys, 8 warps
# (two warpgroups of 64 rows), 2-3 stages of K and V in shared memory: 128 KiB (128x64, 3 stages)
# to 224 KiB (128x128, 3 stages) of the 227 KiB, 197-255 registers, no spills, one program per
# SM. 128 x 64 with 4 warps spills (255 registers + 0.5 KiB): left out. 64 x 64 for small head
# dims and 64-row layouts.
_CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3)]
INTERP_BLOCK_M = INTERP_BLOCK_N = 16    # the interpreter: one small config, no tuning runs
tma_failures: dict[tuple, str] = {}     # (dtype, hd) -> why TMA descriptors failed: pointers there


def _tma_hook(nargs):
    for name in ("desc_k", "desc_v"):
        if nargs.get(name) is not None:
            nargs[name].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_D"]]


def _prune(configs, nargs, **kw):
    """Block sizes must divide the layout's (its tiles are cut into kernel tiles)."""
    bq, bk = kw.get("LAYOUT_BQ", 0), kw.get("LAYOUT_BK", 0)
    keep = [c for c in configs if (bq == 0 or bq % c.kwargs["BLOCK_M"] == 0)
            and (bk == 0 or bk % c.kwargs["BLOCK_N"] == 0)]
    return keep or [triton.Config({"BLOCK_M": min(bq, 64), "BLOCK_N": min(bk, 64)}, num_warps=4, num_stages=2,
                                  pre_hook=_tma_hook)]


# keyed on constants only: nq and Nk change every call and must never re-tune
_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st, pre_hook=_tma_hook)
             for bm, bn, w, st in _CONFIGS],
    key=["HEAD_DIM", "G", "LAYOUT_BQ", "LAYOUT_BK", "TMA", "WS"],
    prune_configs_by={"early_config_prune": _prune})(_attn_fwd)

_dummies: dict = {}


def _dummy(device, dtype):
    key = (str(device), dtype)
    if key not in _dummies:
        _dummies[key] = torch.empty(1, dtype=dtype, device=device)
    return _dummies[key]


def _tma_ok(q, k, v, hd) -> bool:
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401  (triton >= 3.4)
    es = k.element_size()
    return (hd >= 16 and hd & (hd - 1) == 0 and (q.dtype, hd) not in tma_failures
            and all(t.data_ptr() % 16 == 0 and (t.stride(0) * es) % 16 == 0 and (t.stride(1) * es) % 16 == 0
                    for t in (k, v)))


def _desc(t, block):
    from triton.tools.tensor_descriptor import TensorDescriptor
    n, h, hd = t.shape    # 2-D view [N, span of the heads' columns]; the kernel loads [N-rows, hd]
    return TensorDescriptor(t, [n, (h - 1) * t.stride(1) + hd], [t.stride(0), 1], block)


def attention_fwd(out, q, k, v, *, lse=None, layout=None, scale=None, workspace=None, splits=None,  # noqa: C901
                  tma=None, warp_specialize=False) -> None:
    """Launch for attention.attention_into (shapes already checked there)."""
    nq, hq, hd = q.shape
    nk, hkv = k.shape[0], k.shape[1]
    if nq == 0:
        return
    S = splits or num_splits(nq, hq, nk)
    dev = q.device
    f32 = torch.float32
    ws_o = ws_l = _dummy(dev, f32)
    if S > 1:
        need = split_workspace_elems(nq, hq, hd, S)
        if workspace is None:
            workspace = torch.empty(need, dtype=f32, device=dev)
        flat = workspace.view(-1).view(f32)
        if flat.numel() < need:
            raise ValueError(f"split-K workspace holds {flat.numel() * 4} bytes, needs {need * 4}")
        ws_o, ws_l = flat[: S * hq * nq * hd], flat[S * hq * nq * hd: need]
    stride_oh = out.stride(1) if out.dim() == 3 else hd
    if layout is not None:
        indptr, indices, stride_ip = layout.indptr.contiguous(), layout.indices, layout.indptr.stride(0)
        lay = dict(LAYOUT_BQ=layout.block_q, LAYOUT_BK=layout.block_k,
                   LAYOUT_DIV=1 if layout.heads_per_layout == "q" else hq // hkv)
    else:
        indptr, indices, stride_ip = _dummy(dev, torch.int32), _dummy(dev, torch.int32), 0
        lay = dict(LAYOUT_BQ=0, LAYOUT_BK=0, LAYOUT_DIV=1)
    lse_t = lse if lse is not None else _dummy(dev, f32)
    tuned = not interpret() and dev.type == "cuda"
    if tma is None:
        tma = TMA_DEFAULT and tuned and torch.cuda.get_device_capability(dev)[0] >= 9
    tma = bool(tma) and nk > 0 and _tma_ok(q, k, v, hd)
    block_d = max(16, triton.next_power_of_2(hd))
    sm_scale = scale if scale is not None else 1.0 / math.sqrt(hd)

    def launch(use_tma):
        dk = dv = None
        if use_tma:
            dk, dv = _desc(k, [INTERP_BLOCK_N, block_d]), _desc(v, [INTERP_BLOCK_N, block_d])
        args = (q, k, v, out, lse_t, ws_o, ws_l, indptr, indices, dk, dv, nq, nk, hq, sm_scale, S,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                out.stride(0), stride_oh, lse_t.stride(0) if lse is not None else 0, stride_ip)
        kw = dict(HEAD_DIM=hd, BLOCK_D=block_d, G=hq // hkv, WRITE_LSE=lse is not None, SPLIT=S > 1,
                  TMA=use_tma, IEEE=q.dtype == f32 or not tuned, WS=bool(warp_specialize), **lay)
        if tuned:
            _tuned[lambda meta: (triton.cdiv(nq, meta["BLOCK_M"]), hq, S)](*args, **kw)
        else:
            _attn_fwd[(triton.cdiv(nq, INTERP_BLOCK_M), hq, S)](*args, **kw, BLOCK_M=INTERP_BLOCK_M,
                                                                BLOCK_N=INTERP_BLOCK_N)

    if tma:
        try:
            launch(True)
        except Exception as e:  # a Triton without Hopper descriptor support: pointer loads instead
            tma_failures[(q.dtype, hd)] = f"{type(e).__name__}: {str(e)[:400]}"
            launch(False)
    else:
        launch(False)
    if S > 1:
        bm = 16 if not tuned else 64
        _combine[(triton.cdiv(nq, bm), hq)](ws_o, ws_l, out, lse_t, nq, hq, S, out.stride(0), stride_oh,
                                            lse_t.stride(0) if lse is not None else 0, HEAD_DIM=hd,
                                            BLOCK_D=block_d, WRITE_LSE=lse is not None, BLOCK_M=bm)
