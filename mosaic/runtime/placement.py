"""Where the layer weights live: on the device (resident) or packed in pinned host memory
(offloaded, streamed in by graph/stream_ops.streamed_layers). docs/OFFLOAD.md.

Offloading packs each layer into one host byte buffer in the staging slots' layout
(graph/streams.pack_layout), so a layer arrives in one DMA; the buffers are page-locked with
cudaHostRegister (exact size: PyTorch's pinned allocator rounds every allocation up to a power
of two, 17% more for an 436 MB LLaDA-8B layer). Restoring copies them back to the device. On a
CPU there is nothing to move: the "device" is host memory and the copies are plain copies.
"""

from __future__ import annotations

import torch

from ..graph.streams import pack_layout, pin, unpin, views


class WeightPlacement:
    """The layers of `model` on its device or in host memory; `ensure(offloaded)` moves them."""

    def __init__(self, model, device: torch.device):
        self.model, self.device = model, torch.device(device)
        self.packed: list[torch.Tensor] | None = None   # host bytes per layer, when offloaded

    @property
    def offloaded(self) -> bool:
        return self.packed is not None

    @property
    def host_bytes(self) -> int:
        return sum(p.numel() for p in self.packed) if self.packed else 0

    def ensure(self, offloaded: bool) -> bool:
        """Put the layers where a step of this mode needs them; True if anything moved."""
        if self.device.type != "cuda" or offloaded == self.offloaded:
            return False
        if offloaded:
            self._to_host()
        else:
            self._to_device()
        return True

    def _to_host(self) -> None:
        m = self.model
        packed, layers = [], []
        for lw in m.layers:
            layout, nbytes = pack_layout(lw)
            buf = pin(torch.empty(nbytes, dtype=torch.uint8))
            host = views(buf, layout)
            for k, t in lw.items():
                host[k].copy_(t)
            packed.append(buf)
            layers.append(host)
        torch.cuda.synchronize(self.device)
        m.set_packed_layers(layers, packed)    # the device tensors are released here
        self.packed = packed
        torch.cuda.empty_cache()

    def _to_device(self) -> None:
        m = self.model
        layers = [{k: t.to(self.device) for k, t in lw.items()} for lw in m.layers]
        torch.cuda.synchronize(self.device)
        m.set_packed_layers(layers, None)
        for buf in self.packed or ():
            unpin(buf)
        self.packed = None
