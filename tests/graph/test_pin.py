"""graph/streams.pin: a range left registered by a buffer freed without unpin() is dropped before
the same addresses are registered again (a fake cudart that refuses overlapping registrations, as
the driver does with cudaErrorHostMemoryAlreadyRegistered)."""

import torch

from mosaic.graph import streams


class FakeCudart:
    def __init__(self):
        self.ranges: dict[int, int] = {}

    def cudaHostRegister(self, ptr, nbytes, flags):
        if any(a < ptr + nbytes and ptr < a + n for a, n in self.ranges.items()):
            return 712   # cudaErrorHostMemoryAlreadyRegistered
        self.ranges[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr):
        return 0 if self.ranges.pop(ptr, None) is not None else 713


def test_stale_registration_is_dropped_before_registering_again(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(streams, "_PINNED", {})
    big = torch.empty(1 << 20, dtype=torch.uint8)
    assert streams.pin(big) is big                       # registered in place
    # the buffer is dropped without unpin(); the allocator reuses its addresses for a new one
    again = big[1024:].view(torch.uint8)
    out = streams.pin(again)
    assert out.data_ptr() == again.data_ptr()            # registered in place, not copied
    assert list(fake.ranges) == [again.data_ptr()]       # the stale range is gone
    streams.unpin(out)
    assert fake.ranges == {} and streams._PINNED == {}


def test_disjoint_buffers_stay_registered(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(streams, "_PINNED", {})
    a, b = torch.empty(4096, dtype=torch.uint8), torch.empty(4096, dtype=torch.uint8)
    streams.pin(a)
    streams.pin(b)
    assert len(fake.ranges) == 2
