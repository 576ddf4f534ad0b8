"""VmmArena's mapping decisions, hysteresis and accounting, with a fake driver (CPU)."""

import pytest
import torch

from mosaic.memory.vmm import MiB, VmmArena

GRAN = 2 * MiB


class FakeDriver:
    def __init__(self, total=8 * 1024 * MiB):
        self.total, self.mapped, self.live_handles, self.events = total, {}, set(), []
        self.next = 0

    def granularity(self):
        return GRAN

    def total_bytes(self):
        return self.total

    def reserve(self, n):
        assert n % GRAN == 0
        self.va = (1 << 40, n)
        return 1 << 40

    def free(self, va, n):
        assert (va, n) == self.va and not self.mapped
        self.va = None

    def create(self, n):
        assert n % GRAN == 0 and n > 0
        self.next += 1
        self.live_handles.add(self.next)
        return self.next

    def map(self, va, n, h):
        lo = va - (1 << 40)
        assert all(lo + n <= o or o + s <= lo for o, (s, _) in self.mapped.items()), "double map"
        self.mapped[lo] = (n, h)

    def unmap(self, va, n):
        lo = va - (1 << 40)
        assert self.mapped.pop(lo)[0] == n

    def release(self, h):
        self.live_handles.remove(h)

    def record_event(self):
        ev = {"done": False}
        self.events.append(ev)
        return ev

    def event_done(self, ev):
        return ev["done"]

    def wait(self, ev):
        ev["done"] = True

    def tensor(self, va, n):
        return torch.empty(0, dtype=torch.uint8)

    def bytes_mapped(self):
        return sum(s for s, _ in self.mapped.values())


def make(**kw):
    d = FakeDriver()
    return VmmArena("cpu", driver=d, **kw), d


def test_grows_in_large_handles_with_a_granular_tail():
    a, d = make(handle_bytes=256 * MiB)
    a.ensure(600 * MiB + 1)
    sizes = [h.nbytes for h in a.handles]
    assert sizes == [256 * MiB, 256 * MiB, 90 * MiB]  # 600 MiB + 1 byte -> 602 MiB, 2 MiB pages
    assert a.mapped_bytes == d.bytes_mapped() == 602 * MiB and a.map_calls == 3


def test_no_remap_when_the_plan_fits():
    a, d = make()
    a.ensure(300 * MiB)
    calls = a.map_calls
    a.ensure(200 * MiB)   # above the hysteresis threshold: keep everything mapped
    a.ensure(300 * MiB)
    assert a.map_calls == calls and a.unmap_calls == 0


def test_shrink_waits_for_the_gpu_then_unmaps_whole_handles():
    a, d = make(handle_bytes=64 * MiB, hysteresis=0.5)
    a.ensure(512 * MiB)
    a.ensure(100 * MiB)                      # < half: drop handles above 128 MiB
    assert a.mapped_bytes == 128 * MiB
    assert d.bytes_mapped() == 512 * MiB     # the event has not completed: nothing unmapped yet
    assert a.physical_bytes == 512 * MiB
    d.events[-1]["done"] = True
    a.ensure(100 * MiB)                      # the next call reaps
    assert d.bytes_mapped() == 128 * MiB and a.unmap_calls == 6
    assert len(d.live_handles) == 2


def test_peak_and_close_release_everything():
    a, d = make()
    for n in (10, 900, 50, 700, 5):
        a.ensure(n * MiB)
    assert a.peak_bytes == 900 * MiB
    a.close()
    assert d.bytes_mapped() == 0 and not d.live_handles and d.va is None


def test_plan_larger_than_the_reservation_is_refused():
    a, _ = make(reserve_bytes=64 * MiB)
    with pytest.raises(MemoryError, match="exceeds the reserved range"):
        a.ensure(65 * MiB)


@pytest.mark.parametrize("seed", range(5))
def test_random_sequences_keep_accounting_exact(seed):
    g = torch.Generator().manual_seed(seed)
    a, d = make(handle_bytes=128 * MiB)
    for n in torch.randint(1, 2000, (60,), generator=g).tolist():
        a.ensure(n * MiB)
        assert a.mapped_bytes >= n * MiB
        assert a.mapped_bytes == sum(h.nbytes for h in a.handles)
        for ev in d.events:
            ev["done"] = True
        assert d.bytes_mapped() == a.physical_bytes
    a.close()
    assert not d.live_handles


def test_exact_mode_maps_the_plan_and_nothing_above_it():
    d = FakeDriver()
    a = VmmArena(torch.device("cpu"), driver=d, handle_bytes=64 * MiB, exact=True)
    for size in (300, 290, 40, 41, 700, 1, 699):
        a.ensure(size * MiB)
        assert a.mapped_bytes == a.physical_bytes == size * MiB + (size % 2) * MiB
        assert sum(n for n, _ in d.mapped.values()) == a.mapped_bytes and not a.pending
        assert all(ev["done"] for ev in d.events)   # every unmap waited for the GPU first
    assert len(d.live_handles) == len(a.handles)
    a.close()
    assert not d.mapped and not d.live_handles


def test_exact_mode_settles_pages_left_pending_before_it_was_switched_on():
    d = FakeDriver()
    a = VmmArena(torch.device("cpu"), driver=d, handle_bytes=64 * MiB)
    a.ensure(512 * MiB)
    a.ensure(100 * MiB)                 # hysteresis: top handles wait for an event
    assert a.pending and a.physical_bytes > a.mapped_bytes
    a.exact = True
    a.ensure(100 * MiB)
    assert not a.pending and a.physical_bytes == a.mapped_bytes == 100 * MiB


def test_host_arena_exact_mode_follows_the_plan_down():
    from mosaic.memory.arena import HostArena
    from mosaic.memory.planner import align
    a = HostArena("cpu")
    a.ensure(10_000)
    a.ensure(4_000)
    assert a.mapped_bytes == align(10_000)      # default: keeps the larger tensor
    a.exact = True
    a.ensure(4_000)
    assert a.mapped_bytes == align(4_000) and a.peak_bytes == align(10_000)


def test_trim_unmaps_above_the_new_plan_at_once_and_never_maps():
    """The budget's guard trims before it caps PyTorch for a smaller plan: every page
    above the plan is gone (pending ones included) before anything else allocates."""
    d = FakeDriver()
    a = VmmArena(torch.device("cpu"), driver=d, handle_bytes=64 * MiB)
    a.ensure(512 * MiB)
    a.ensure(100 * MiB)                 # hysteresis: pages pending, still on the device
    a.trim(300 * MiB)
    assert not a.pending and a.physical_bytes <= 300 * MiB
    maps = a.map_calls
    a.trim(90 * MiB)
    assert a.physical_bytes <= 90 * MiB and a.map_calls == maps
    a.trim(0)
    assert a.physical_bytes == 0 and not d.mapped
    a.ensure(50 * MiB)
    assert a.mapped_bytes == 50 * MiB


def test_host_arena_trim_drops_a_larger_buffer_only():
    from mosaic.memory.arena import HostArena
    a = HostArena("cpu")
    a.ensure(10_000)
    a.trim(20_000)
    assert a.mapped_bytes > 0
    a.trim(4_000)
    assert a.mapped_bytes == 0
