"""RoPE ops of the step program (mixed into graph.ctx.Ctx): per call, or with the step's cos /
sin tables computed once and read by every layer (a block step: rope_tables, then rope_pair_
on q and k in one launch per layer)."""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels import elementwise as E
from ..kernels import invariant as INV
from ..kernels import reference as R

F32 = torch.float32


class RopeOps:
    """Mixed into graph.ctx.Ctx (its new / use / op / external / pointwise_scratch)."""

    def rope_(self, t, positions, inv_freq, fp32):
        n, heads, _ = t.shape
        half = inv_freq.shape[0]
        rows = min(n, R.ROW_TILE)
        with self.op("rope"):
            sdt = F32 if fp32 else t.dtype
            s1 = self.new("rope_s1", (rows, heads, half), sdt)
            s2 = self.new("rope_s2", (rows, heads, half), sdt)
            c, s = self.new("rope_cos", (rows, half), F32), self.new("rope_sin", (rows, half), F32)
            self.use(t, writes=(s1, s2, c, s))
            self.pointwise_scratch(2)
            if self.compute:
                E.rope_(t, positions, inv_freq, fp32, s1, s2, c, s, self.elementwise_kernel, self.batch_invariant)

    def rope_tables(self, positions, inv_freq):
        """(cos, sin) [n, half] fp32 of positions [n] (n <= ROW_TILE): computed once per step and
        read by every layer's rope_pair_ (a block step's 32 layers x 2 ropes computed them 64
        times, 4 launches each)."""
        n, half = positions.shape[0], inv_freq.shape[0]
        assert n <= R.ROW_TILE, "rope tables are for steps of at most one row tile"
        with self.op("rope_tables"):
            c, s = self.new("rope_tab_cos", (n, half), F32), self.new("rope_tab_sin", (n, half), F32)
            self.use(writes=(c, s))
            invariant = self.batch_invariant and not kernels.want_triton(self.device.type, self.elementwise_kernel)
            if invariant:
                self.external(INV.pointwise_bytes(2))
            if self.compute:
                (INV.rope_cos_sin if invariant else R.rope_cos_sin)(c, s, positions, inv_freq)
        return c, s

    def rope_pair_(self, q, k, tables, fp32: bool) -> None:
        """RoPE in place on q [n, Hq, hd] and k [n, Hk, hd] (either may be None) with the step's
        tables (rope_tables, the rows of these positions): one launch on the fused path."""
        c, s = tables
        ts = [t for t in (q, k) if t is not None]
        rows, heads = min(ts[0].shape[0], R.ROW_TILE), max(t.shape[1] for t in ts)
        with self.op("rope"):
            sdt = F32 if fp32 else ts[0].dtype
            s1 = self.new("rope_s1", (rows, heads, c.shape[1]), sdt)
            s2 = self.new("rope_s2", (rows, heads, c.shape[1]), sdt)
            self.use(*ts, c, s, writes=(s1, s2))
            if self.compute:
                E.rope_pair_(q, k, c, s, fp32, s1, s2, self.elementwise_kernel)

    def qkv_rope_store(self, qkv, k_out, v_out, tables, hq: int, hk: int, hd: int, fp32: bool) -> None:
        """A fused q|k|v projection's rows qkv [n, (hq + 2 hk) hd]: q rotated in place, k rotated
        into k_out and v copied into v_out (the store's rows [n, hk hd]), with the step's tables;
        one launch on the fused path (kernels/elementwise.qkv_rope_store)."""
        c, s = tables
        rows = min(qkv.shape[0], R.ROW_TILE)
        with self.op("qkv_rope_store"):
            sdt = F32 if fp32 else qkv.dtype
            s1 = self.new("rope_s1", (rows, max(hq, hk), c.shape[1]), sdt)
            s2 = self.new("rope_s2", (rows, max(hq, hk), c.shape[1]), sdt)
            self.use(qkv, c, s, writes=(k_out, v_out, s1, s2))
            if self.compute:
                E.qkv_rope_store(qkv, k_out, v_out, c, s, hq, hk, hd, fp32, s1, s2, self.elementwise_kernel)
