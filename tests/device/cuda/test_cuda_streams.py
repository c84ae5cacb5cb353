"""GPU: priorities, timing events, wait_any, worker pools, errors from launches."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from ringflow._device.cuda.measure import Spin

pytestmark = pytest.mark.gpu


def test_priorities(cuda_device):
    least, greatest = cuda_device.capabilities.stream_priorities
    lo, hi = cuda_device.create_stream(priority=least), cuda_device.create_stream(priority=greatest)
    assert (lo.priority, hi.priority) == (least, greatest)
    with pytest.raises(ValueError):
        cuda_device.create_stream(priority=greatest - 1)
    lo.close()
    hi.close()


def test_timing_events_measure_a_kernel(cuda_device):
    dev = cuda_device
    s = dev.create_stream()
    spin = Spin(dev)
    e0 = s.record(timing=True)
    spin(s, 2e-3)
    e1 = s.record(timing=True)
    plain = s.record()
    assert plain.timing is False
    e1.sync()
    assert 1.9e-3 <= e1.elapsed_since(e0) < 50e-3
    with pytest.raises(ValueError, match="timing"):
        plain.elapsed_since(e0)
    spin.close()
    s.close()


@pytest.fixture
def two_streams(cuda_device):
    """(device, s1, s2, spin, a 1 MiB device buffer allocated on s1, a 1 MiB pinned buffer),
    all released after the test."""
    dev = cuda_device
    s1, s2 = dev.create_stream(), dev.create_stream()
    spin = Spin(dev)
    d, h = dev.allocate(1 << 20, stream=s1), dev.allocate_host(1 << 20)
    yield dev, s1, s2, spin, d, h
    d.close(stream=s1)
    spin.close()
    h.close()
    s1.close()
    s2.close()


def test_ordering_across_streams_with_wait(two_streams):
    """A copy on s2 that waits for a slow kernel-then-fill on s1 sees the fill's bytes."""
    dev, s1, s2, spin, d, h = two_streams
    s1.fill(d, 1)
    spin(s1, 20e-3)
    s1.fill(d, 2)
    s2.wait(s1.record())
    s2.copy(h, d)
    s2.sync()
    assert (h.view() == 2).all()


def test_waiting_on_an_event_the_host_saw_complete_still_orders(two_streams):
    """A wait on an event already seen done is skipped (no driver call); what the second stream
    enqueues afterwards still sees the first stream's work, and a pending event is waited on."""
    dev, s1, s2, spin, d, h = two_streams
    s1.fill(d, 3)
    done = s1.record()
    done.sync()
    assert done.is_done
    s2.wait(done)  # skipped: the fill is complete
    spin(s1, 20e-3)
    s1.fill(d, 4)
    pending = s1.record()
    assert not pending.is_done
    s2.wait(pending)  # enqueued: the copy below must wait for the second fill
    s2.copy(h, d)
    s2.sync()
    assert (h.view() == 4).all()


def test_a_wait_for_an_event_of_another_device_names_both_devices_and_what_to_do(cuda_device):
    """The same ValueError, in the same words, as the simulated GPU's (test_bad_input's
    test_a_wait_for_an_event_of_another_device_names_both_devices_and_what_to_do): it was a
    TypeError here. The driver would take the wait (cuStreamWaitEvent orders across devices);
    ringflow refuses it on both backends, since the simulated GPU cannot order one device's work
    after another's. With one GPU the other device is a second device object of cuda:0."""
    import re

    from ringflow._device.cuda import CudaDevice
    from ringflow._device.cuda._lib import core

    other = CudaDevice(1 if len(core().Device.get_all_devices()) > 1 else 0)
    try:
        theirs = other.create_stream()
        s = cuda_device.create_stream()
        there = "cuda:1" if other.index == 1 else "another device object that is also cuda:0 (make the device once " \
                                                  "and use that one object)"
        says = (rf"^<CudaStream 0x[0-9a-f]+ priority -?\d+ on cuda:0> of cuda:0 cannot wait for <CudaEvent event on "
                rf".*>, recorded on {re.escape(there)}: a stream waits only for events of its own device \(the "
                r"simulated GPU cannot order one device's work after another's, so neither backend takes such a "
                r"wait\); order the two through the host instead: event\.sync\(\), then enqueue the work on this "
                r"stream$")
        e = theirs.record()
        with pytest.raises(ValueError, match=says):
            s.wait(e)
        e.sync()  # refused whether or not the event is complete
        with pytest.raises(ValueError, match=says):
            s.wait(e)
        s.wait(s.record())  # the stream is still usable
        s.sync()
        s.close()
        theirs.close()
        del e
    finally:
        other.close()


def test_wait_any_events_and_host_tasks(cuda_device):
    dev = cuda_device
    s = dev.create_stream()
    spin = Spin(dev)
    spin(s, 0.2)
    slow = s.record()
    with dev.create_worker_pool(2) as pool:
        task = pool.submit(time.sleep, 0.01)
        t0 = time.perf_counter()
        done = dev.wait_any([slow, task])
        assert done == [task] and time.perf_counter() - t0 < 0.15
        assert task.result() is None
        assert dev.wait_any([slow], timeout=0) == []
        t0 = time.perf_counter()
        assert dev.wait_any([slow], timeout=0.01) == []
        assert time.perf_counter() - t0 < 0.1
        assert dev.wait_any([slow]) == [slow]
        assert slow.is_done and slow.error is None
        failing = pool.submit(lambda: 1 / 0)
        failing.sync()
        with pytest.raises(ZeroDivisionError):
            failing.result()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(print)
    with pytest.raises(ValueError):
        dev.wait_any([])
    spin.close()
    s.close()


def test_launch_error_propagates_unchanged(cuda_device):
    dev = cuda_device
    s = dev.create_stream()
    d = dev.allocate(64, stream=s)
    boom = ValueError("user compute failed")

    def fn(x):
        raise boom

    with pytest.raises(ValueError) as info:
        s.launch(fn, d.array(np.float32, 16))
    assert info.value is boom
    s.record().sync()  # the stream is still usable
    d.close(stream=s)
    s.close()


def test_live_counts_follow_close(cuda_device):
    dev = cuda_device
    s = dev.create_stream()
    events = [s.record() for _ in range(10)]
    bufs = [dev.allocate(1024, stream=s) for _ in range(3)] + [dev.allocate_host(1024)]
    live = dev.live()
    assert (live.streams, live.events, live.device_buffers, live.host_buffers) == (1, 10, 3, 1)
    events[0].close()
    events[0].close()
    assert dev.live().events == 9
    del events
    for b in bufs:
        b.close()
    s.close()
    assert dev.live().total == 0, dev.live()


STICKY = textwrap.dedent(r'''
    import numpy as np, ringflow as rf
    from ringflow._errors import DeviceError
    from ringflow._kernel import Kernel
    bad = Kernel(r"""extern "C" __global__ void bad(const unsigned* x, unsigned* y, size_t n) {
        unsigned* p = (unsigned*)0x10; p[threadIdx.x] = 1u; }""", "bad")
    dev = rf.device("cuda:0", array="dlpack")
    s = dev.create_stream()
    buf = dev.allocate(1024, stream=s)
    s.launch(bad, buf.array(np.uint32, 256), buf.array(np.uint32, 256))
    e = s.record()
    try:
        e.sync()
        print("NO ERROR")
    except DeviceError as exc:
        print("STICKY", exc.sticky, "|", exc)
    print("DONE", e.is_done, type(e.error).__name__)
''')


def test_sticky_error_becomes_device_error():
    """An illegal address breaks the context: run it in a child process, not this one."""
    out = subprocess.run([sys.executable, "-c", STICKY], capture_output=True, text=True, timeout=120)
    assert "STICKY True" in out.stdout, out.stdout + out.stderr
    assert "context is broken" in out.stdout
    assert "DONE True DeviceError" in out.stdout



POOL_AFTER_STICKY = textwrap.dedent(r'''
    import gc
    import numpy as np, ringflow as rf
    from ringflow._errors import DeviceError
    from ringflow._kernel import Kernel
    bad = Kernel(r"""extern "C" __global__ void bad(const unsigned* x, unsigned* y, size_t n) {
        unsigned* p = (unsigned*)0x10; p[threadIdx.x] = 1u; }""", "bad")
    dev = rf.device("cuda:0", array="dlpack")
    kept = rf.host.empty(1 << 20, np.uint8, device=dev)
    kept[:] = 5
    cached = rf.host.empty(1 << 20, np.uint8, device=dev)
    del cached
    gc.collect()
    s = dev.create_stream()
    buf = dev.allocate(1024, stream=s)
    s.launch(bad, buf.array(np.uint32, 256), buf.array(np.uint32, 256))
    try:
        s.record().sync()
        print("NO ERROR")
    except DeviceError as exc:
        print("STICKY", exc.sticky)
    print("READ", int(kept.sum()) == 5 << 20)
    st = rf.host.stats(device=dev)
    print("STATS", st.cached_bytes >= 1 << 20)
    again = rf.host.empty(1 << 20, np.uint8, device=dev)
    again[:] = 7
    print("CACHED", rf.host.stats(device=dev).in_use_bytes >= 2 << 20, int(again[0]))
    try:
        rf.host.empty(64 << 20, np.uint8, device=dev)
        print("NEW ok")
    except DeviceError as exc:
        print("NEW DeviceError", exc.sticky)
''')


def test_pinned_memory_and_the_pools_cache_stay_usable_after_a_sticky_error():
    """What the simulated GPU models after a sticky error (a host view of a pinned buffer needs
    no CUDA call), checked on a GPU in a child process: host memory pinned before the fault is
    still read and written, the pool's counters are read and its cached blocks handed out; a
    new pinned allocation fails with a sticky DeviceError."""
    out = subprocess.run([sys.executable, "-c", POOL_AFTER_STICKY], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert "STICKY True" in lines, out.stdout + out.stderr
    assert "READ True" in lines and "STATS True" in lines and "CACHED True 7" in lines, out.stdout + out.stderr
    assert "NEW DeviceError True" in lines, out.stdout + out.stderr  # (as on the simulated GPU)

def test_closed_streams_are_reused_only_when_idle():
    """A closed stream's CUDA stream goes to the device's idle list; create_stream hands it out
    again only once the work it still had has finished, so no new owner queues behind it."""
    import ringflow as rf

    with rf.device("cuda:0") as dev:  # a device of its own: an empty idle list
        spin = Spin(dev)
        s = dev.create_stream()
        handle = s.handle
        s.close()
        s2 = dev.create_stream()
        assert s2.handle == handle  # idle: reused
        spin(s2, 0.2)
        s2.close()  # still spinning
        s3 = dev.create_stream()
        assert s3.handle != handle  # busy: a new stream instead
        t0 = time.perf_counter()
        s3.record().sync()  # not queued behind the spin
        assert time.perf_counter() - t0 < 0.1
        time.sleep(0.25)
        s4 = dev.create_stream()
        assert s4.handle == handle  # the spin finished: reused now
        for st in (s3, s4):
            st.close()
        spin.close()
        assert dev.live().total == 0


def test_recycled_events_keep_earlier_waits():
    """An event whose CudaEvent was collected is re-recorded by a later record(); a wait
    enqueued before that keeps waiting for the point it captured, not the new one."""
    import ringflow as rf

    with rf.device("cuda:0") as dev:
        s1, s2 = dev.create_stream(), dev.create_stream()
        spin = Spin(dev)
        d, h = dev.allocate(1 << 20, stream=s1), dev.allocate_host(1 << 20)
        s1.fill(d, 1)
        spin(s1, 20e-3)
        s1.fill(d, 2)
        e = s1.record()
        s2.wait(e)
        reused = e._cc
        del e  # its CUDA event goes back to the device
        spin(s1, 300e-3)
        s1.fill(d, 3)
        late = s1.record()
        assert late._cc is reused  # re-recorded after the second spin
        s2.copy(h, d)
        t0 = time.perf_counter()
        s2.sync()
        assert time.perf_counter() - t0 < 0.2  # waited for the first point only
        assert (h.view() == 2).all()
        assert not late.is_done
        late.sync()
        assert dev.live().events == 1
        del late
        assert dev.live().events == 0
        d.close(stream=s1)
        h.close()
        spin.close()
        for st in (s1, s2):
            st.close()
        assert dev.live().total == 0


def test_the_timing_floor_is_small_and_measured_once(cuda_device):
    s = cuda_device.create_stream()
    try:
        floor = cuda_device.timing_floor(s)
        assert 0.0 <= floor < 50e-6
        assert cuda_device.timing_floor(s) == floor  # kept: measured once per device
    finally:
        s.close()
