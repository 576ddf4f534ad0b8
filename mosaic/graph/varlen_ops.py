"""Ctx ops of batched steps: one attention over every sequence of the step (variable lengths,
kernels/varlen.py), the per-sequence attention it falls back to, and the batched write of the
step's fresh K/V into the block stores: a part of graph/ctx.Ctx.

`attend_now` is the one definition of "attention of one sequence" (ctx.attention runs it, the
varlen loop runs it per entry), so a sequence in a batched step computes exactly what it
computes alone wherever the loop kernel runs (the CPU; batch-invariant mode)."""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels import attention as A
from ..kernels import invariant as INV
from ..kernels import reference as R
from ..kernels import varlen as VL


class VarlenOps:
    def attend_now(self, out, q, k, v, workspace=None, own: bool = False):
        """out [nq, Hq*hd] = attention of q [nq, Hq, hd] over k, v [Nk, Hkv, hd] with this
        context's per-sequence kernel: batch-invariant (no split-K on CUDA, fixed query tiles on
        the CPU), Mosaic's Triton kernel ('triton'), or PyTorch's SDPA ('sdpa' / 'cudnn'). Returns
        the result: out, or with own=True SDPA's own output where its layout is out's."""
        if self.batch_invariant:
            if kernels.want_triton(self.device.type, "auto", "attention"):
                A.attention_into(out, q, k, v, splits=1)
            else:
                INV.attention_tiles(out, q, k, v)
        elif self.attention_kernel == "triton":
            A.attention_into(out, q, k, v, workspace=workspace)
        else:
            cudnn = kernels.prefer_cudnn_attention(self.device, q.dtype, q.shape[2], max(q.numel(), k.numel()),
                                                   self.attention_kernel)
            return R.attention(out, q, k, v, cudnn, own=own)
        return out

    def attend_external(self, q_shape, k) -> int:
        """Bytes attend_now allocates outside the plan for q of q_shape over k: SDPA's output
        before the copy and the regrouped (cuDNN: contiguous) q, its fp32 log-sum-exp rows (the
        memory-efficient kernel pads them to 32); the CPU invariant tiles; nothing for Triton
        (planned workspace) or the CUDA invariant kernel."""
        nq, hq, hd = q_shape
        itemsize = k.element_size()
        if self.batch_invariant:
            if kernels.want_triton(self.device.type, "auto", "attention"):
                return 0
            return INV.attention_tile_bytes(torch.empty(q_shape, dtype=k.dtype, device="meta"))
        if self.attention_kernel == "triton":
            return 0
        cudnn = kernels.prefer_cudnn_attention(self.device, k.dtype, hd, max(nq * hq * hd, k.numel()),
                                               self.attention_kernel)
        groups = 2 if hq != k.shape[1] or cudnn else 1
        return groups * nq * hq * hd * itemsize + hq * (nq + 32) * 4

    def attention_varlen(self, name, q, k, v, ent: VL.Entries, kernel: str):
        """out [T, Hq*hd]: every entry's query rows of q [T, Hq, hd] against its own key rows of
        k, v [R, Hkv, hd] (a block store or the paged pool, outside the plan), in one call (flash,
        efficient, gather) or one attend_now per entry (loop); kernel: kernels.varlen_kernel's
        choice, made with the step (a captured step's key depends on it)."""
        T, hq, hd = q.shape
        with self.op("attention"):
            out = self.new(name, (T, hq * hd))
            ws = None
            if kernel == "loop" and self.attention_kernel == "triton" and not self.batch_invariant:
                ws = self.new("attn_ws", (max(1, A.workspace_bytes(ent.max_q, hq, hd, max(1, ent.max_k))),),
                              torch.uint8)
            self.use(q, k, v, writes=(out,) if ws is None else (out, ws))
            per_entry = self.attend_external((max(1, ent.max_q), hq, hd), k)
            self.external(VL.external_bytes(kernel, T, ent.num_entries, ent.max_q, hq, hd, q.element_size(),
                                            per_entry, ent.max_k))
            if self.compute:
                VL.attention_into(out, q, k, v, ent, kernel,
                                  attend=lambda o, qq, kk, vv: self.attend_now(o, qq, kk, vv, ws))
        return out

    def kv_scatter(self, k, v, K, V, rows) -> None:
        """K[rows[i]] = k[i], V[rows[i]] = v[i]: a batched step's fresh K/V [n, kv_dim] written
        into its stores' rows (K, V [R, kv_dim] outside the plan) by one copy each, not one per
        sequence."""
        with self.op("kv_write"):
            self.use(k, v)
            if self.compute:
                K.index_copy_(0, rows, k)
                V.index_copy_(0, rows, v)
