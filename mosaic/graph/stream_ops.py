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
from .streams import CopyEngine, HostPool, Offload, Prefetcher, WriteBack, pack_layout, stream_attention, views

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

    def written_back(self, hosts, bounds, n_slots: int = 2):
        """Iterate the chunk loop over `bounds` ((start, end) rows) of a computation whose rows
        end in host memory: yields (start, end, bufs), bufs one device buffer [end - start,
        *row shape] per host tensor in `hosts` for the caller to fill; each chunk is then copied
        to hosts[i][start:end] on the copy engine's side stream while the next one computes
        (streams.WriteBack). The n_slots buffers per host tensor are planned (allocated before
        the loop, live through it: admission charges them); after the loop the compute stream
        waits for the last copies, so the planner may reuse their bytes."""
        rows = max(e - s for s, e in bounds)
        n = min(n_slots, len(bounds))
        wb = None
        with self.op("kv_stage"):
            slots = [[self.new(f"{name}_dev", (rows, *h.shape[1:]), h.dtype) for name, h in hosts.items()]
                     for _ in range(n)]
            flat = [t for ts in slots for t in ts]
            self.use(writes=flat)
            if self.compute:
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
                    wb.release(c, [(h[s:e], t) for h, t in zip(hosts.values(), bufs)])
        with self.op("kv_written"):
            self.use(writes=flat)     # their bytes are free only after this op
            if wb is not None:
                wb.drain()

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
            part = self.new("attn_part", (nq, hq * hd))
            part_lse = self.new("lse_part", (hq, nq), F32)
            acc = self.new("attn_acc", (nq, hq * hd), F32)
            acc_lse = self.new("lse_acc", (hq, nq), F32)
            new, w = self.new("lse_new", (hq, nq), F32), self.new("lse_w", (hq, nq), F32)
            ws = self.new("attn_ws", (max(1, A.workspace_bytes(nq, hq, hd, kb)),), torch.uint8)
            self.use(q, writes=(out, *kslots, *vslots, part, part_lse, acc, acc_lse, new, w, ws))
            if self.compute:
                impl = "auto" if self.device.type == "cuda" else "torch"
                stream_attention(self.copy_engine(), out, q, k_host, v_host, kslots, vslots, part,
                                 part_lse, acc.view(nq, hq, hd), acc_lse, new, w, ws, impl)
        return out
