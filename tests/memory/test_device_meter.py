"""The device-memory sampler with a scripted fake driver (CPU)."""

import threading
import time

import pytest

from mosaic.memory.device_meter import DeviceMeter, nvml_index

MiB = 2**20


class FakeDriver:
    """Device used = driver reserve + context + whatever the test sets; per-process figure only
    when `per_process` (as NVML outside a container)."""

    def __init__(self, reserve=600 * MiB, per_process=False, pid=1234):
        self.reserve, self.per_process, self.pid = reserve, per_process, pid
        self.process = 0          # this process's bytes
        self.other = 0            # another process on the same device
        self.reads = 0

    def device_used(self):
        self.reads += 1
        return self.reserve + self.process + self.other

    def process_used(self, pid):
        return self.process if self.per_process and pid == self.pid else None

    def total(self):
        return 141 * 2**30


def test_device_mode_subtracts_the_pre_context_baseline():
    d = FakeDriver()
    m = DeviceMeter(d, pid=1234)
    assert m.set_baseline() == 600 * MiB
    d.process = 900 * MiB                       # context + weights appear after the baseline
    assert m.mode == "device" and m.read() == 900 * MiB


def test_process_mode_ignores_other_processes():
    d = FakeDriver(per_process=True)
    m = DeviceMeter(d, pid=1234)
    d.process, d.other = 5 * MiB, 700 * MiB
    assert m.mode == "process" and m.read() == 5 * MiB


def test_mode_can_be_forced_and_is_checked():
    d = FakeDriver(per_process=True)
    assert DeviceMeter(d, pid=1234, mode="device").read() == 600 * MiB   # no baseline set
    with pytest.raises(ValueError):
        DeviceMeter(d, mode="nvml")


def test_window_peak_start_end_and_time_of_peak():
    d = FakeDriver(per_process=True)
    t = [0.0]
    m = DeviceMeter(d, pid=1234, clock=lambda: t[0])
    d.process = 100
    with m.window() as w:
        for v, at in ((300, 1.0), (250, 2.0), (120, 3.0)):
            d.process, t[0] = v, at
            m.sample()
        d.process, t[0] = 110, 4.0
    assert (w.start_bytes, w.end_bytes, w.peak_bytes) == (100, 110, 300)
    assert w.peak_at_s == 1.0 and w.seconds == 4.0 and w.samples == 4   # 3 + the closing read


def test_windows_nest_and_the_meter_keeps_its_lifetime_peak():
    d = FakeDriver(per_process=True)
    m = DeviceMeter(d, pid=1234)
    with m.window() as outer:
        d.process = 50
        m.sample()
        with m.window() as inner:
            d.process = 80
            m.sample()
            d.process = 10
        m.sample()
    assert inner.peak_bytes == 80 and outer.peak_bytes == 80 and m.peak_bytes == 80
    with m.window() as later:
        pass
    assert later.peak_bytes == 10 and m.peak_bytes == 80


def test_the_thread_catches_a_short_rise():
    d = FakeDriver(per_process=True)
    m = DeviceMeter(d, pid=1234, interval_s=0.001, keep_timeline=True)
    with m:
        with m.window() as w:
            time.sleep(0.02)
            d.process = 256 * MiB   # a late caching-allocator segment, as in the first GPU soak
            time.sleep(0.05)
            d.process = 0
            time.sleep(0.02)
    assert w.peak_bytes == 256 * MiB and w.samples >= 10
    assert m._thread is None and len(m.timeline) == m.samples
    n = d.reads
    time.sleep(0.01)
    assert d.reads == n          # stopped: no more reads


def test_a_failing_read_does_not_kill_the_thread():
    class Flaky(FakeDriver):
        def device_used(self):
            self.reads += 1
            if self.reads % 2:
                raise RuntimeError("NVML hiccup")
            return 7
    m = DeviceMeter(Flaky(), pid=1, mode="device", interval_s=0.001)
    m.start()
    deadline = time.time() + 2
    while m.samples < 3 and time.time() < deadline:
        time.sleep(0.005)
    m.stop()
    assert m.samples >= 3 and m.peak_bytes == 7
    assert not any(t.name == "device-meter" for t in threading.enumerate())


def test_nvml_index_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert nvml_index(1) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert nvml_index(0) == 3 and nvml_index(1) == 5
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")
    assert nvml_index(0) == 0
