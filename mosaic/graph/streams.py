"""Host memory streamed through planned device buffers: the copy engine, the weight prefetch
schedule and the key/value block stream (docs/OFFLOAD.md).

A CopyEngine issues copies on a side CUDA stream and orders them against the compute stream
with events: `mark()` records an event on the compute stream (everything enqueued so far),
`copy(pairs, after)` makes the side stream wait for `after`, copies, and returns the copy's
event, `wait(event)` makes the compute stream wait for it. On a CPU the copies are plain
synchronous copies and events are None. Tests substitute engines with a simulated clock.

Three schedules use it, all over buffers the plan owns (so admission charges them):
  Prefetcher     layer weights from pinned host memory into S staging slots, S - 1 layers
                 ahead: slot i % S holds layer i; the copy of layer i + S into that slot waits
                 for the event recorded after layer i's compute (compute -> overwrite), and layer
                 i's compute waits for its copy's event (copy -> compute).
  WriteBack      K and V to host memory, chunk by chunk through S device slots: chunk c is
                 computed into slot c % S and copied to host on the side stream while the
                 compute stream goes on (the first query chunk's attention to it, the next
                 chunk's projections); chunk c + S's compute waits for that copy (copy ->
                 overwrite).
  stream_attention  one query chunk against K and V in host memory: key blocks through two
                 slots (block j + 2 is copied while block j + 1 is computed), each block's
                 partial output and log-sum-exp merged into an fp32 accumulator (BlockMerge).
All copies run on the one side stream, in issue order: a read of K/V rows from host memory is
queued after the write of those rows, and a layer's writes after the previous layer's reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import attention as A

ALIGN = 256   # bytes: every staged tensor starts on a 256-byte boundary (cuBLAS, TMA, vector loads)


@dataclass(frozen=True)
class Offload:
    """How a step streams from host memory. ahead: layers copied ahead of the computing one
    (staging slots = ahead + 1); kv: K and V also live in host memory; kv_block_rows: key rows
    per streamed block; min_query_rows: the fewest query rows per attention chunk the chunk
    search may use with kv (each chunk reads all of K and V over PCIe: policy/offload.py);
    kv_write_slots: device chunk buffers K and V are written back through (2: each chunk's
    copy to host overlaps the first query chunk's attention to it and the next chunk's
    projections; 1: the compute stream waits for every copy as soon as it is issued, the
    schedule without overlap)."""
    ahead: int = 1
    kv: bool = False
    kv_block_rows: int = 32768
    min_query_rows: int = 0
    kv_write_slots: int = 2

    @property
    def mode(self) -> str:
        return "weights+kv" if self.kv else "weights"


class CopyEngine:
    """Copies on one side stream (CUDA) or synchronous copies (CPU); see the module docstring."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        self.bytes_copied = 0

    def mark(self):
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def copy(self, pairs, after=None):
        """Copy each (dst, src) after event `after`; returns the event of their completion."""
        self.bytes_copied += sum(d.numel() * d.element_size() for d, _ in pairs)
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return None
        with torch.cuda.stream(self.side):
            if after is not None:
                self.side.wait_event(after)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.side)
        return ev

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


_PINNED: dict[int, int] = {}   # data_ptr -> bytes of host buffers registered by pin()


def pin(buf: torch.Tensor) -> torch.Tensor:
    """Page-lock a contiguous host tensor in place (cudaHostRegister: exactly its size, where
    PyTorch's pinned allocator would round up to a power of two); a copy from pin_memory() when
    registering is refused. Without CUDA the tensor is returned as it is."""
    if not torch.cuda.is_available() or buf.numel() == 0:
        return buf
    ptr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
    # A registered buffer freed without unpin() (an engine dropped without close()) leaves its
    # range registered; the allocator may hand the same addresses out again, and registering
    # them fails with cudaErrorHostMemoryAlreadyRegistered, an error PyTorch then reports at its
    # next kernel launch (bench_offload's L_max parts, c36a732). The stale ranges are ours:
    # drop them first.
    for old in [a for a, n in _PINNED.items() if a < ptr + nbytes and ptr < a + n]:
        del _PINNED[old]
        torch.cuda.cudart().cudaHostUnregister(old)
    try:
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
    except (AttributeError, RuntimeError, TypeError):
        err = -1
    if err != 0:
        return buf.pin_memory()
    _PINNED[ptr] = nbytes
    return buf


def unpin(buf: torch.Tensor) -> None:
    """Undo pin() before the tensor is released (no-op for other tensors)."""
    if _PINNED.pop(buf.data_ptr(), None) is not None:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


class HostPool:
    """Grow-only host buffers by name (pinned when they feed a GPU): a request's K and V, reused
    by every layer and every later request that fits them."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < nbytes:
            old = self.bufs.pop(name, None)
            if old is not None:
                if self.pin:
                    torch.cuda.synchronize()     # no copy may still read or write it
                unpin(old)
            buf = torch.empty(nbytes, dtype=torch.uint8)
            buf = pin(buf) if self.pin else buf
            self.bufs[name] = buf
        return buf[:nbytes].view(dtype).view(tuple(shape))

    def clear(self) -> None:
        if self.pin and self.bufs:
            torch.cuda.synchronize()
        for buf in self.bufs.values():
            unpin(buf)
        self.bufs.clear()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.bufs.values())


def pack_layout(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, tuple[int, tuple, torch.dtype]], int]:
    """Offsets of a layer's tensors packed into one byte buffer: ({name: (offset, shape, dtype)},
    total bytes), each tensor at a multiple of ALIGN."""
    out, off = {}, 0
    for name, t in tensors.items():
        out[name] = (off, tuple(t.shape), t.dtype)
        off += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return out, off


def views(slot: torch.Tensor, layout: dict) -> dict[str, torch.Tensor]:
    """The tensors of `layout` as views of the byte buffer `slot`."""
    out = {}
    for name, (off, shape, dtype) in layout.items():
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        out[name] = slot[off: off + n].view(dtype).view(shape)
    return out


class Prefetcher:
    """Layer weights through len(slots) staging slots (module docstring). host_layers[i] is a
    dict of tensors (pinned host memory on a GPU); layouts[i] its pack_layout."""

    def __init__(self, engine, slots: list[torch.Tensor], layouts: list[dict], host_layers: list[dict],
                 packed: list[torch.Tensor] | None = None):
        self.engine, self.slots, self.layouts, self.host = engine, slots, layouts, host_layers
        self.packed = packed          # host bytes of each layer in its layout: one copy per layer
        self.S = len(slots)
        self.copied = [None] * self.S     # slot -> event: its current layer has landed
        self.freed = [None] * self.S      # slot -> event: compute is done with its last layer

    def _issue(self, i: int) -> None:
        s = i % self.S
        if self.packed is not None:
            n = self.packed[i].numel()
            pairs = [(self.slots[s][:n], self.packed[i])]
        else:
            dst = views(self.slots[s], self.layouts[i])
            pairs = [(dst[k], self.host[i][k]) for k in dst]
        self.copied[s] = self.engine.copy(pairs, after=self.freed[s])

    def start(self) -> None:
        """Issue the first S layers; the slots' bytes may have held other buffers until now."""
        first = self.engine.mark()
        self.freed = [first] * self.S
        for i in range(min(self.S, len(self.host))):
            self._issue(i)

    def acquire(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's weights, the compute stream ordered after their copy."""
        s = i % self.S
        self.engine.wait(self.copied[s])
        return views(self.slots[s], self.layouts[i])

    def release(self, i: int) -> None:
        """Layer i's compute is enqueued: its slot takes layer i + S once that compute is done."""
        s = i % self.S
        self.freed[s] = self.engine.mark()
        if i + self.S < len(self.host):
            self._issue(i + self.S)


class WriteBack:
    """Chunks computed into S device slots and copied to host memory (module docstring): chunk
    c uses slot c % S; its copy waits for a mark taken after its compute, and the compute of
    chunk c + S waits for that copy, so a slot is never overwritten before its bytes are read.
    With S = 1 the compute stream waits for each copy at once (no overlap). drain() orders the
    compute stream after every copy (the slots' bytes may then be reused)."""

    def __init__(self, engine, n_slots: int):
        self.engine, self.S = engine, n_slots
        self.written = [None] * n_slots   # slot -> event: its last chunk has reached host memory

    def acquire(self, c: int) -> None:
        """Chunk c may be computed into slot c % S: the copy of chunk c - S has finished."""
        self.engine.wait(self.written[c % self.S])

    def release(self, c: int, pairs) -> None:
        """Chunk c's compute is enqueued: copy each (host dst, slot src) on the side stream."""
        self.written[c % self.S] = self.engine.copy(list(pairs), after=self.engine.mark())
        if self.S == 1:
            self.engine.wait(self.written[0])

    def drain(self) -> None:
        for ev in self.written:
            self.engine.wait(ev)
        self.written = [None] * self.S


def merge_into(acc, acc_lse, o, lse, new, w) -> None:
    """Fold one key block's (o [nq, H*hd] any float dtype, lse fp32 [H, nq]) into the running
    (acc fp32 [nq, H, hd], acc_lse [H, nq]) in place; new, w: fp32 [H, nq] scratch. Every lse is
    finite (each block has at least one key), so no -inf - -inf arises."""
    nq, h, hd = acc.shape
    torch.logaddexp(acc_lse, lse, out=new)
    torch.sub(acc_lse, new, out=w)
    acc.mul_(w.exp_().t()[:, :, None])
    torch.sub(lse, new, out=w)
    acc.addcmul_(o.view(nq, h, hd), w.exp_().t()[:, :, None])
    acc_lse.copy_(new)


class BlockMerge:
    """Attention of q [nq, Hq, hd] over key blocks given one at a time (add), merged in
    log-sum-exp form into acc fp32 [nq, Hq, hd] and acc_lse [Hq, nq] (merge_into); part
    [nq, Hq*hd], part_lse, new, w [Hq, nq]: scratch; workspace: the kernel's. Exact: equals
    softmax over all the keys added, up to fp32 rounding (FlashAttention's online softmax,
    Dao 2022, applied per block)."""

    def __init__(self, q, part, part_lse, acc, acc_lse, new, w, workspace, impl: str = "auto"):
        self.q, self.part, self.part_lse, self.acc, self.acc_lse = q, part, part_lse, acc, acc_lse
        self.new, self.w, self.workspace, self.impl = new, w, workspace, impl
        self.started = False

    def add(self, k, v) -> None:
        """Fold the block k, v [nk >= 1, Hkv, hd] in (the first block starts the accumulator)."""
        nq, hq, hd = self.q.shape
        if not self.started:
            A.attention_into(self.part, self.q, k, v, lse=self.acc_lse, impl=self.impl, workspace=self.workspace)
            self.acc.copy_(self.part.view(nq, hq, hd))
            self.started = True
        else:
            A.attention_into(self.part, self.q, k, v, lse=self.part_lse, impl=self.impl, workspace=self.workspace)
            merge_into(self.acc, self.acc_lse, self.part, self.part_lse, self.new, self.w)

    def finish(self, out) -> None:
        """out [nq, Hq*hd] = the merged attention (in out's dtype)."""
        out.view(self.acc.shape).copy_(self.acc)


def stream_attention(engine, out, q, k_host, v_host, kslots, vslots, part, part_lse, acc, acc_lse,
                     new, w, workspace, impl: str = "auto") -> None:
    """out [nq, Hq*hd] = attention of q [nq, Hq, hd] over k_host, v_host [Nk, Hkv, hd] (host
    memory), key blocks of kslots[s].shape[0] rows streamed through the two slots and merged
    (BlockMerge)."""
    nk, kb = k_host.shape[0], kslots[0].shape[0]
    blocks = [(a, min(nk, a + kb)) for a in range(0, nk, kb)]
    freed, copied = [engine.mark()] * 2, [None, None]

    def issue(j):
        s, (a, b) = j % 2, blocks[j]
        copied[s] = engine.copy([(kslots[s][: b - a], k_host[a:b]), (vslots[s][: b - a], v_host[a:b])],
                                after=freed[s])

    for j in range(min(2, len(blocks))):
        issue(j)
    merge = BlockMerge(q, part, part_lse, acc, acc_lse, new, w, workspace, impl)
    for j, (a, b) in enumerate(blocks):
        s = j % 2
        engine.wait(copied[s])
        merge.add(kslots[s][: b - a], vslots[s][: b - a])
        freed[s] = engine.mark()
        if j + 2 < len(blocks):
            issue(j + 2)
    merge.finish(out)
