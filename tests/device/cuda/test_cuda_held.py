"""GPU: a chunk's copies, launches and event records keep the GIL (``_device/cuda/_held.py``), so
another busy Python thread does not make each one wait for a switch interval."""

from __future__ import annotations

import statistics
import sys
import threading
import time

import numpy as np
import pytest

from ringflow._bench import kernels
from ringflow._device.cuda import _held

pytestmark = pytest.mark.gpu


def _median_us(fn, calls: int = 40) -> float:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def test_the_held_calls_are_the_ones_used(cuda_device):
    dev = cuda_device
    assert _held.calls() is not None
    f = kernels.scale_shift()
    s = dev.create_stream()
    buf = dev.allocate(4096)
    try:
        x = buf.array(np.float32, (1024,))
        s.launch(f, x, x)
        s.record().sync()
        assert f.kernel._functions[dev.index]  # the launch went through cuLaunchKernel here
    finally:
        s.close()
        buf.close()


def test_calls_beside_a_busy_thread_do_not_wait_for_the_gil(cuda_device):
    dev = cuda_device
    n = 1 << 20
    h, d = dev.allocate_host(n), dev.allocate(n)
    s = dev.create_stream()
    f = kernels.scale_shift()
    x = d.array(np.float32, (n // 4,))
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            sum(range(100))

    t = threading.Thread(target=busy, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.02)  # a convoy would cost each call ~20 ms: far from a held call's microseconds
    t.start()
    try:
        s.record().sync()
        copy_us = _median_us(lambda: s.copy(d, h, n))
        launch_us = _median_us(lambda: s.launch(f, x, x))
        record_us = _median_us(lambda: s.record())
        s.record().sync()
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)
        s.close()
        d.close()
        h.close()
    assert copy_us < 2000 and launch_us < 2000 and record_us < 2000, (copy_us, launch_us, record_us)
