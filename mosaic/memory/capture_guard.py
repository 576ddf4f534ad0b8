"""A CUDA stream capture runs alone in the process.

While a thread captures a step (runtime/graph_backend.py), a device-wide call from any thread
invalidates the capture: torch.cuda.synchronize / cudaDeviceSynchronize, an event wait, the
virtual-memory arena's unmap (which waits for the device first), torch.cuda.empty_cache's
cudaFree (CUDA's programming guide: "it is invalid to synchronize or query the execution status
of ... a device or context handle when any associated stream is in capture mode"). The capture
then fails with cudaErrorStreamCaptureInvalidated at its next op. Seen on the H200 behind
`mosaic serve` (bench/results/gpu/session7/everyday_2a23023.log): an engine dropped by the
benchmark was collected by Python's cyclic garbage collector during a capture on the server's
engine thread, and its arena's finalizer synchronised the device inside the capture.

So a capture holds CAPTURE_LOCK with the cyclic collector off (`capturing_alone`), and Mosaic's
device-wide calls that may run on another thread (an arena's close or finalizer, an engine's
close) take the same lock (`device_wide`): they wait for the capture to end. The lock is
reentrant, so such a call made by the capturing thread itself does not deadlock (it is a bug
there either way: the collector being off keeps finalizers out)."""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

CAPTURE_LOCK = threading.RLock()


@contextmanager
def capturing_alone():
    """Hold CAPTURE_LOCK and keep the cyclic garbage collector off (it runs finalizers, e.g. an
    arena's, on whatever thread allocates) for the length of a capture."""
    with CAPTURE_LOCK:
        was = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if was:
                gc.enable()


def device_wide():
    """The context a device-wide call (synchronize, unmap, empty_cache) runs in from any thread:
    it waits while a capture runs."""
    return CAPTURE_LOCK
