"""A CUDA virtual-memory arena: one reserved address range, physical pages mapped under it only
up to the current plan's high-water mark.

Mapping cost is per handle (~50 us per cuMemMap), not per byte, so growth maps handles of up to
256 MiB, with a tail rounded to the 2 MiB granularity. The plan's offsets never move: the range
is reserved once (the card's size), so views stay valid as the mapping grows. Shrinking (when the
plan falls under `hysteresis` of what is mapped) unmaps whole handles from the top, but only once
a CUDA event recorded after the last kernel that could touch them has completed: cuMemUnmap does
not wait for running kernels.

Under a memory budget the arena runs `exact`: it maps exactly the plan's pages (rounded to the
granularity), shrinking at once (waiting for the GPU first) instead of keeping up to a handle
or half the mapping above the plan, because the budget charges the plan, not the history.

The policy (VmmArena) is separate from the driver calls (CudaDriver), so the mapping decisions
and the accounting are tested on the CPU with a fake driver."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .capture_guard import device_wide

MiB = 2**20


def vmm_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


class CudaDriver:
    """The few cuda.bindings.driver calls the arena needs, with every return code checked."""

    def __init__(self, device: torch.device):
        from cuda.bindings import driver as cu
        self.cu = cu
        torch.empty(1, device=device)  # make sure PyTorch's primary context is current
        self.ordinal = device.index if device.index is not None else torch.cuda.current_device()
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.ordinal
        self.prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.ordinal
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = access
        self.device = device

    def _ok(self, result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            name = self.cu.cuGetErrorName(err)[1]
            raise RuntimeError(f"CUDA driver call failed: {name.decode() if name else err}")
        return rest[0] if len(rest) == 1 else rest

    def granularity(self) -> int:
        flag = self.cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        return int(self._ok(self.cu.cuMemGetAllocationGranularity(self.prop, flag)))

    def reserve(self, nbytes: int) -> int:
        return int(self._ok(self.cu.cuMemAddressReserve(nbytes, 0, 0, 0)))

    def free(self, va: int, nbytes: int) -> None:
        self._ok(self.cu.cuMemAddressFree(self.cu.CUdeviceptr(va), nbytes))

    def create(self, nbytes: int):
        return self._ok(self.cu.cuMemCreate(nbytes, self.prop, 0))

    def map(self, va: int, nbytes: int, handle) -> None:
        ptr = self.cu.CUdeviceptr(va)
        self._ok(self.cu.cuMemMap(ptr, nbytes, 0, handle, 0))
        self._ok(self.cu.cuMemSetAccess(ptr, nbytes, [self.access], 1))

    def unmap(self, va: int, nbytes: int) -> None:
        self._ok(self.cu.cuMemUnmap(self.cu.CUdeviceptr(va), nbytes))

    def release(self, handle) -> None:
        self._ok(self.cu.cuMemRelease(handle))

    def record_event(self):
        ev = torch.cuda.Event()
        ev.record()
        return ev

    @staticmethod
    def event_done(ev) -> bool:
        return ev.query()

    @staticmethod
    def wait(ev) -> None:
        ev.synchronize()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def total_bytes(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    def tensor(self, va: int, nbytes: int) -> torch.Tensor:
        return torch.as_tensor(_CudaRange(va, nbytes), device=self.device)


class _CudaRange:
    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3}


@dataclass
class _Handle:
    offset: int
    nbytes: int
    handle: object


@dataclass
class VmmArena:
    device: torch.device
    driver: object = None
    handle_bytes: int = 256 * MiB
    hysteresis: float = 0.5          # unmap only when the plan falls under this share of mapped
    reserve_bytes: int | None = None
    exact: bool = False              # map exactly the plan's pages (a budget charges no more)
    kind: str = "vmm"
    handles: list = field(default_factory=list)
    pending: list = field(default_factory=list)   # (event, handles) waiting to be unmapped
    mapped_bytes: int = 0
    peak_bytes: int = 0
    map_calls: int = 0
    unmap_calls: int = 0

    def __post_init__(self):
        self.device = torch.device(self.device)
        if self.driver is None:
            self.driver = CudaDriver(self.device)
        self.gran = self.driver.granularity()
        size = self.reserve_bytes or self.driver.total_bytes()
        self.reserved = self._round(size)
        self.base = self.driver.reserve(self.reserved)
        self._view = None

    def _round(self, n: int) -> int:
        return -(-n // self.gran) * self.gran

    def ensure(self, nbytes: int) -> None:
        """Map up to nbytes (rounded to the granularity); unmap the top handles when the need
        has fallen under the hysteresis share of what is mapped."""
        self._reap()
        need = self._round(max(nbytes, 1))
        if need > self.reserved:
            raise MemoryError(f"arena plan of {need} bytes exceeds the reserved range {self.reserved}")
        if self.mapped_bytes < need and self.pending:
            self._adopt(need)
        if self.exact and need < self.mapped_bytes:
            self._shrink_exact(need)
        self._grow(need)
        if self.exact and self.pending:  # pages still waiting for the GPU count on the device
            self._reap(wait=True)
        if need < self.hysteresis * self.mapped_bytes:
            drop = []
            while self.handles and self.handles[-1].offset >= need:
                drop.append(self.handles.pop())
            if drop:
                self.mapped_bytes = drop[-1].offset
                self.pending.append((self.driver.record_event(), drop))
                self._reap()

    def trim(self, nbytes: int) -> None:
        """Unmap every page above `nbytes` (rounded to the granularity) now, the handle that
        straddles it included, once the GPU is done with them; never maps. The budget's guard
        calls this before it caps PyTorch for a smaller plan, so that the old plan's pages and
        the new step's PyTorch allocations never coexist (the second GPU soak's overruns)."""
        self._reap(wait=True)
        need = self._round(max(nbytes, 0))
        if need < self.mapped_bytes:
            self._shrink_exact(need)

    def _grow(self, need: int) -> None:
        while self.mapped_bytes < need:
            size = min(self.handle_bytes, self._round(need - self.mapped_bytes))
            h = self.driver.create(size)
            self.driver.map(self.base + self.mapped_bytes, size, h)
            self.handles.append(_Handle(self.mapped_bytes, size, h))
            self.mapped_bytes += size
            self.map_calls += 1
        self.peak_bytes = max(self.peak_bytes, self.mapped_bytes)

    def _shrink_exact(self, need: int) -> None:
        """Unmap everything above `need`, the handle that straddles it included (its lower
        part is mapped again by _grow), once the GPU is done with the pages; nothing stays
        pending, so physical_bytes is the mapping."""
        drop = []
        while self.handles and self.handles[-1].offset + self.handles[-1].nbytes > need:
            drop.append(self.handles.pop())
        if drop:
            self.mapped_bytes = drop[-1].offset
            self.pending.append((self.driver.record_event(), drop))
        self._reap(wait=True)

    def _adopt(self, need: int) -> None:
        """Take back handles that wait to be unmapped (they are still mapped) instead of mapping
        new pages over them, lowest first, as far as `need` asks."""
        waiting = sorted((h for _, hs in self.pending for h in hs), key=lambda h: h.offset)
        taken = set()
        for h in waiting:
            if self.mapped_bytes >= need or h.offset != self.mapped_bytes:
                break
            self.handles.append(h)
            self.mapped_bytes += h.nbytes
            taken.add(id(h))
        self.pending = [(ev, [h for h in hs if id(h) not in taken]) for ev, hs in self.pending]
        self.pending = [(ev, hs) for ev, hs in self.pending if hs]

    def _reap(self, wait: bool = False) -> None:
        keep = []
        for ev, handles in self.pending:
            if wait:
                self.driver.wait(ev)
            if wait or self.driver.event_done(ev):
                for h in handles:
                    self.driver.unmap(self.base + h.offset, h.nbytes)
                    self.driver.release(h.handle)
                    self.unmap_calls += 1
            else:
                keep.append((ev, handles))
        self.pending = keep

    @property
    def physical_bytes(self) -> int:
        """Mapped now plus handles still waiting for the GPU before they are unmapped."""
        return self.mapped_bytes + sum(h.nbytes for _, hs in self.pending for h in hs)

    def tensor(self) -> torch.Tensor:
        if self._view is None:  # one byte tensor over the whole reserved range, made once
            self._view = self.driver.tensor(self.base, self.reserved)
        return self._view[: self.mapped_bytes]

    def close(self) -> None:
        if self.base is None:
            return
        with device_wide():     # it waits for the device: never while another thread captures
            self._close()

    def _close(self) -> None:
        # kernels queued on any stream may still read or write the pages: unmapping does not
        # wait for them, so wait for the device first
        self.driver.wait(self.driver.record_event())
        if hasattr(self.driver, "synchronize"):
            self.driver.synchronize()
        self._reap(wait=True)
        for h in reversed(self.handles):
            self.driver.unmap(self.base + h.offset, h.nbytes)
            self.driver.release(h.handle)
            self.unmap_calls += 1
        self.handles, self.mapped_bytes, self._view = [], 0, None
        self.driver.free(self.base, self.reserved)
        self.base = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
