"""GPU: CUDA graphs captured from our streams and replayed, and ``MapJob(graph=True)`` on them:
replays compute on the data there now, bit for bit as an ordinary call; a compute the capture
cannot take (it allocates, or synchronises) is refused, logged, and the job runs without a graph."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import ringflow as rf
from ringflow._bench import kernels
from ringflow._errors import CaptureError

pytestmark = pytest.mark.gpu
N = 1 << 16


def test_a_captured_round_trip_replays_on_new_data(cuda_device):
    dev = cuda_device
    h, d, o = dev.allocate_host(4 * N), dev.allocate(4 * N), dev.allocate_host(4 * N)
    a, b = dev.create_stream(), dev.create_stream()
    k = kernels.scale_shift()
    a.begin_capture()
    a.copy(d, h)
    b.wait(a.record())
    b.launch(k, d.array(np.float32, N), d.array(np.float32, N))
    a.wait(b.record())
    a.copy(o, d)
    graph = a.end_capture()
    for call in range(3):
        values = np.random.default_rng(call).uniform(size=N).astype(np.float32)
        h.view(np.float32)[:] = values
        graph.launch(a)
        a.sync()
        assert np.array_equal(o.view(np.float32), values * np.float32(2) + np.float32(1))
    graph.close()
    graph.close()
    for obj in (a, b, d, h, o):
        obj.close()
    assert dev.live().total == 0


def test_capture_refuses_a_wait_on_an_earlier_event_and_the_stream_works_after(cuda_device):
    dev = cuda_device
    a, b = dev.create_stream(), dev.create_stream()
    d = dev.allocate(4 * N)
    b.fill(d, 0)
    earlier = b.record()
    a.begin_capture()
    try:
        a.wait(earlier)
        a.fill(d, 1)
        a.end_capture()
    except (CaptureError, rf.DeviceError):
        a.abort_capture()
    else:
        pytest.fail("a capture that waits for an event recorded before it was accepted")
    a.fill(d, 2)  # the stream is an ordinary stream again
    a.sync()
    for obj in (a, b, d):
        obj.close()


def _job(dev, f, x, **kw):
    return rf.MapJob(f, x, device=dev, chunk_bytes=1 << 16, host="register", graph=True, **kw)


def test_mapjob_replays_bit_exact_with_a_kernel(cuda_device):
    x = np.random.default_rng(0).uniform(size=1 << 20).astype(np.float32)
    with _job(cuda_device, kernels.scale_shift(), x, checked=True, compute_streams=2) as job:
        for call in range(4):
            x[:] = np.random.default_rng(call).uniform(size=x.size).astype(np.float32)
            assert np.array_equal(job(), x * np.float32(2) + np.float32(1))
            assert job.replays_graph is (call > 0)  # the first call warms the kernel
        job(profile=True)
        assert not job.replays_graph
        x[:] = 3
        assert (job() == 7).all() and job.replays_graph
        assert job.enqueue_seconds / job.chunks < 50e-6


def test_mapjob_replays_a_cupy_compute_that_writes_into_y(cuda_device):
    cp = pytest.importorskip("cupy")

    def f(x, y):
        cp.multiply(x, np.float32(2), out=y)
        cp.add(y, np.float32(1), out=y)

    x = np.random.default_rng(1).uniform(size=1 << 20).astype(np.float32)
    with _job(cuda_device, f, x) as job:
        for call in range(3):
            x[:] = np.random.default_rng(call).uniform(size=x.size).astype(np.float32)
            assert np.array_equal(job(), x * np.float32(2) + np.float32(1))
            assert job.replays_graph is (call > 0)


def test_mapjob_replays_keep_the_host_values_f_read_while_captured(cuda_device):
    """A replay runs the kernels ``f`` enqueued while captured, never ``f``: a Python value it
    read then (a scale) stays, as the simulated GPU's replays keep it (test_direct_graph)."""
    cp = pytest.importorskip("cupy")
    calls, scale = [], [1.0]

    def f(x, y):
        calls.append(1)
        cp.multiply(x, np.float32(scale[0]), out=y)

    x = np.ones(1 << 20, np.float32)
    with _job(cuda_device, f, x) as job:
        seen, called = [], []
        for call in range(4):
            scale[0] = float(call + 1)
            seen.append((float(job()[0]), job.replays_graph))
            called.append(len(calls))
        assert seen == [(1.0, False), (2.0, True), (2.0, True), (2.0, True)]
        assert called[1] > called[0] > 0 and called[3] == called[2] == called[1]  # f ran for the capture only


@pytest.mark.parametrize("kind", ["cupy temporaries", "cupy sync", "torch temporaries"])
def test_a_compute_the_capture_cannot_take_is_refused_and_logged(cuda_device, caplog, kind):
    if kind.startswith("cupy"):
        cp = pytest.importorskip("cupy")
        if kind == "cupy temporaries":
            def f(x, y):
                y[...] = x * 2 + 1  # x * 2 is a new array from CuPy's pool
        else:
            def f(x, y):
                cp.multiply(x, np.float32(2), out=y)
                cp.add(y, np.float32(1), out=y)
                cp.cuda.get_current_stream().synchronize()
        array = "cupy"
    else:
        torch = pytest.importorskip("torch")
        torch.zeros(1, device="cuda")  # the caching allocator is in use

        def f(x, y):
            y.copy_(x * 2 + 1)
        array = "torch"
    from ringflow._device.cuda import CudaDevice

    dev = CudaDevice(0, array=array)
    x = np.random.default_rng(2).uniform(size=1 << 20).astype(np.float32)
    try:
        with caplog.at_level(logging.WARNING, logger="ringflow"), _job(dev, f, x) as job:
            for call in range(3):
                x[:] = np.random.default_rng(call).uniform(size=x.size).astype(np.float32)
                assert np.array_equal(job(), x * np.float32(2) + np.float32(1))
                assert not job.replays_graph
        warned = [r.getMessage() for r in caplog.records if "could not be captured" in r.getMessage()]
        assert len(warned) == 1, warned
    finally:
        dev.close()
