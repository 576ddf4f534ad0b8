"""Ctx ops that stream from host memory (weights, K and V): a mixin of graph/ctx.Ctx.

Every device buffer they use is allocated with `new`, so the plan holds it and admission charges
it: the weight staging slots (allocated before the layer loop, live through it), the device
chunk buffers K and V are written back through, the key/value block slots, the fp32
accumulator of the block merge. Host buffers (a layer's K and V) come
from `host_new`: a grow-only pinned pool at run time, recorded as host bytes in the template.
"""

from __future__ import annotations

import torch

from ..kernels import attention as A
from .streams import (
    BlockMerge,
    CopyEngine,
    HostPool,
    Offload,
    Prefetcher,
    WriteBack,
    pack_layout,
    stream_attention,
    views,
)

F32 = torch.float32


class StreamOps:
    copier = None      # CopyEngine (one side stream per engine); made on first use
    host_pool = None   # HostPool; made on first use

    def copy_engine(self):
        if self.copier is None:
            self.copier = CopyEngine(self.device)
        return self.copier

    def host_new(self, name: str, shape, dtype=None) -> torch.Tensor:
        """A host-memory buffer (pinned on a GPU), outside the device plan."""
        if self.host_pool is None:
            self.host_pool = HostPool(pin=self.device.type == "cuda")
        return self.host_pool.get(name, shape, dtype or self.dtype)

    def streamed_layers(self, layers: list[dict], offload: Offload, packed=None):
        """Iterate the layer loop with each layer's weights copied from `layers` (host memory)
        into offload.ahead + 1 planned staging slots, offload.ahead layers ahead (Prefetcher).
        Yields the staged weights of each layer as views, like `layers()` yields device dicts.
        packed: each layer's host bytes in pack_layout order (runtime/placement.py), one copy each."""
        layouts = [pack_layout(lw) for lw in layers]
        slot_bytes = max(n for _, n in layouts)
        n_slots = min(offload.ahead + 1, len(layers))
        pf = None
        with self.op("weights_stage"):
            slots = [self.new("w_stage", (slot_bytes,), torch.uint8) for _ in range(n_slots)]
            self.use(writes=slots)
            if self.compute:
                pf = Prefetcher(self.copy_engine(), slots, [lay for lay, _ in layouts], layers, packed)
                pf.start()
        for i in self.loop(range(len(layers))):
            with self.op("weights_wait"):
                self.use(writes=slots)     # live through the loop; weights are never poison-checked
                lw = pf.acquire(i) if pf is not None else views(slots[0], layouts[0][0])
            yield lw
            if pf is not None:
                pf.release(i)

    def written_back(self, names, row_shape, bounds, hosts=None, n_slots: int = 2, then=None):
        """Iterate the chunk loop over `bounds` ((start, end) rows) of a computation whose rows
        may end in host memory: yields (start, end, bufs), bufs one device buffer [end - start,
        *row_shape] per name for the caller to fill. With `hosts` (one host tensor per name),
        each chunk is then copied to hosts[i][start:end] on the copy engine's side stream while
        the next one computes (streams.WriteBack), through n_slots buffers per name; without,
        one buffer per name (the compute stream is in order). then(start, end, bufs): ops on the
        filled chunk issued after its copy, which they overlap. The buffers are planned
        (allocated before the loop, live through it: admission charges them); after the loop
        the compute stream waits for the last copies, so the planner may reuse their bytes."""
        rows = max(e - s for s, e in bounds)
        n = min(n_slots, len(bounds)) if hosts else 1
        wb = None
        with self.op("kv_stage"):
            slots = [[self.new(f"{name}_dev", (rows, *row_shape)) for name in names] for _ in range(n)]
            flat = [t for ts in slots for t in ts]
            self.use(writes=flat)
            if self.compute and hosts:
                wb = WriteBack(self.copy_engine(), n)
        for c, (s, e) in enumerate(self.loop(bounds)):
            with self.op("kv_slot_wait"):
                self.use(writes=flat)     # live through the loop
                if wb is not None:
                    wb.acquire(c)
            bufs = [t[: e - s] for t in slots[c % n]]
            yield s, e, bufs
            with self.op("to_host"):
                self.use(*bufs)
                if wb is not None:
                    wb.release(c, [(h[s:e], t) for h, t in zip(hosts, bufs)])
            if then is not None:
                then(s, e, bufs)
        with self.op("kv_written"):
            self.use(writes=flat)     # their bytes are free only after this op
            if wb is not None:
                wb.drain()

    def _merge_buffers(self, nq, hq, hd, block_rows):
        """BlockMerge's buffers after q: part, part_lse, acc, acc_lse, new, w, workspace."""
        part = self.new("attn_part", (nq, hq * hd))
        part_lse = self.new("lse_part", (hq, nq), F32)
        acc = self.new("attn_acc", (nq, hq * hd), F32)
        acc_lse = self.new("lse_acc", (hq, nq), F32)
        new, w = self.new("lse_new", (hq, nq), F32), self.new("lse_w", (hq, nq), F32)
        ws = self.new("attn_ws", (max(1, A.workspace_bytes(nq, hq, hd, block_rows)),), torch.uint8)
        return part, part_lse, acc, acc_lse, new, w, ws

    def _impl(self) -> str:
        return "auto" if self.device.type == "cuda" else "torch"

    def merge_begin(self, name, q, block_rows: int):
        """Start the attention of q [nq, Hq, hd] over key blocks of at most block_rows rows that
        the program builds on the device and hands to merge_block one at a time; merge_end
        returns out [nq, Hq*hd]. The merge's buffers (attention_streamed's, planned) live from
        here to merge_end."""
        nq, hq, hd = q.shape
        with self.op("attention_begin"):
            bufs = (self.new(name, (nq, hq * hd)), *self._merge_buffers(nq, hq, hd, max(1, block_rows)))
            self.use(q, writes=bufs)
            out, part, part_lse, acc, acc_lse, new, w, ws = bufs
            merge = BlockMerge(q, part, part_lse, acc.view(nq, hq, hd), acc_lse, new, w, ws, self._impl()) \
                if self.compute else None
        return q, bufs, merge

    def merge_block(self, state, k, v, skip: int = 0) -> None:
        """Fold the key block k, v [n, Hkv, hd] (its first `skip` rows left out: left padding)
        into the merge that merge_begin started; a block of padding only is left out whole."""
        q, bufs, merge = state
        with self.op("attention"):
            self.use(q, k, v, writes=bufs)
            if merge is not None and k.shape[0] > skip:
                merge.add(k[skip:], v[skip:])

    def merge_end(self, state):
        q, bufs, merge = state
        with self.op("attention_end"):
            self.use(q, writes=bufs)
            if merge is not None:
                merge.finish(bufs[0])
        return bufs[0]

    def attention_streamed(self, name, q, k_host, v_host, block_rows: int):
        """out [nq, Hq*hd] = attention of q [nq, Hq, hd] (device) over k_host, v_host [Nk, Hkv, hd]
        (host memory), key blocks of block_rows streamed through two planned slots and merged in
        log-sum-exp form into a planned fp32 accumulator (streams.stream_attention). Mosaic's
        attention kernel on CUDA (Triton, lse output), its PyTorch oracle on a CPU."""
        nq, hq, hd = q.shape
        nk, hkv = k_host.shape[0], k_host.shape[1]
        kb = max(1, min(block_rows, nk))
        with self.op("attention"):
            out = self.new(name, (nq, hq * hd))
            kslots = [self.new("k_blk", (kb, hkv, hd)) for _ in range(2)]
            vslots = [self.new("v_blk", (kb, hkv, hd)) for _ in range(2)]
            merge = self._merge_buffers(nq, hq, hd, kb)
            self.use(q, writes=(out, *merge, *kslots, *vslots))
            if self.compute:
                part, part_lse, acc, acc_lse, new, w, ws = merge
                stream_attention(self.copy_engine(), out, q, k_host, v_host, kslots, vslots, part,
                                 part_lse, acc.view(nq, hq, hd), acc_lse, new, w, ws, self._impl())
        return out
