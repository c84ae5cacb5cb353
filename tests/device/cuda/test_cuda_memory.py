"""GPU: buffers, fills, copies in every direction, bad input, leak accounting."""

from __future__ import annotations

import numpy as np
import pytest

import ringflow as rf
from ringflow._device.cuda import CudaDevice
from tests.helpers.dtypes import NOT_DEVICE_DTYPES, NOT_DEVICE_IDS, refusal
from tests.helpers.pages import check_pinning_within_a_page

from .helpers_cuda import array_kinds

pytestmark = pytest.mark.gpu


def test_factory_gives_the_cuda_backend():
    with rf.device("cuda:0") as dev:
        assert dev.backend == "cuda"
        caps = dev.capabilities
        assert caps.backend == "cuda" and caps.sm_count > 0 and caps.total_memory > 0
        assert caps.async_engine_count >= 1
        least, greatest = caps.stream_priorities
        assert greatest <= least
        assert caps.unified_addressing
        t0 = dev.now
        assert dev.now >= t0


def test_copies_in_every_direction_bit_exact(cuda_device):
    dev = cuda_device
    n = 3 * (1 << 20) + 7  # not a round size
    rng = np.random.default_rng(5)
    s = dev.create_stream()
    h1, h2, h3 = dev.allocate_host(n), dev.allocate_host(n), dev.allocate_host(n)
    d1, d2 = dev.allocate(n, stream=s), dev.allocate(n, stream=s)
    data = rng.integers(0, 256, n, dtype=np.uint8)
    h1.view()[:] = data
    h2.view().fill(0)
    h3.view().fill(0)
    s.copy(d1, h1)          # H2D
    s.copy(d2, d1)          # D2D
    s.copy(h2, d2)          # D2H
    s.copy(h3, h1)          # H2H (pinned to pinned)
    s.sync()
    np.testing.assert_array_equal(h2.view(), data)
    np.testing.assert_array_equal(h3.view(), data)
    # byte ranges: copy the middle of d1 to the start of h2
    h2.view().fill(0)
    s.copy(h2.slice(0, 1000), d1.slice(12345, 1000))
    s.sync()
    np.testing.assert_array_equal(h2.view(count=1000), data[12345:13345])
    assert not h2.view()[1000:].any()
    for b in (d1, d2):
        b.close(stream=s)
    s.close()
    for b in (h1, h2, h3):
        b.close()
    assert dev.live().total == 0, dev.live()


def test_fill_device_and_pinned_host(cuda_device):
    dev = cuda_device
    s = dev.create_stream()
    n = 1 << 16
    d, h = dev.allocate(n, stream=s), dev.allocate_host(n)
    s.fill(d, 0x5A)
    s.fill(d.slice(100, 50), 7)
    s.copy(h, d)
    s.sync()
    expect = np.full(n, 0x5A, np.uint8)
    expect[100:150] = 7
    np.testing.assert_array_equal(h.view(), expect)
    s.fill(h, 0x33)  # memset straight into pinned host memory
    s.sync()
    assert (h.view() == 0x33).all()
    with pytest.raises(ValueError, match="byte"):
        s.fill(d, 256)
    d.close()
    h.close()
    s.close()


def test_bad_input_is_refused(cuda_device):
    dev = cuda_device
    s = dev.create_stream()
    for bad in (0, -1):
        with pytest.raises(ValueError, match="positive"):
            dev.allocate(bad, stream=s)
        with pytest.raises(ValueError, match="positive"):
            dev.allocate_host(bad)
    with pytest.raises(TypeError):
        dev.allocate(1.5)
    small, big = dev.allocate(100, stream=s), dev.allocate_host(1000)
    with pytest.raises(ValueError, match="does not fit"):
        s.copy(small, big, 200)
    with pytest.raises(ValueError, match="does not fit"):
        s.copy(big, small, 101)
    with pytest.raises(ValueError):
        small.slice(50, 51)
    with pytest.raises(ValueError, match="device memory"):
        s.launch(lambda x: None, big.array(np.uint8, 10))
    with pytest.raises(TypeError, match="typed arrays"):
        s.launch(lambda x: None, small)
    with pytest.raises(ValueError):
        dev.register_host(np.zeros((8, 8))[:, ::2])
    with pytest.raises(TypeError):
        dev.register_host([1, 2, 3])
    with pytest.raises(ValueError):
        dev.register_host(np.zeros(0))
    with pytest.raises(ValueError, match="priority"):
        dev.create_stream(priority=dev.capabilities.stream_priorities[0] + 1)
    small.close(stream=s)
    small.close()  # twice: harmless
    with pytest.raises(RuntimeError, match="closed"):
        s.copy(small, big, 10)
    with pytest.raises(RuntimeError, match="closed"):
        small.array(np.uint8, 10)
    big.close()
    s.close()
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.record()
    with pytest.raises(RuntimeError, match="closed"):
        dev.allocate(10, stream=s)
    other = CudaDevice(0)
    try:
        s2, foreign = dev.create_stream(), other.allocate_host(64)
        mine = dev.allocate_host(64)
        with pytest.raises(ValueError, match="does not belong"):
            s2.copy(mine, foreign)
        mine.close()
        s2.close()
    finally:
        other.close()
    assert other.live().total == 0


def test_pinned_view_outlives_close(cuda_device):
    h = cuda_device.allocate_host(1 << 20)
    v = h.view(np.float32)
    h.close()
    assert cuda_device.live().host_buffers == 0
    v[:] = 1.5  # the memory is still alive: the view holds it
    assert float(v.sum()) == 1.5 * v.size
    with pytest.raises(RuntimeError, match="closed"):
        h.view()


def test_registered_buffer_unregisters_on_close(cuda_device):
    dev = cuda_device
    a = np.arange(1 << 18, dtype=np.float64)
    h = dev.register_host(a)
    h.close()
    h2 = dev.register_host(a)  # registering again works only if close unregistered it
    assert h2.view(np.float64)[5] == 5.0
    h2.close()
    ro = np.arange(1024, dtype=np.uint8)
    ro.flags.writeable = False
    h3 = dev.register_host(ro)
    assert not h3.view(access="rw").flags.writeable
    h3.close()


def test_device_close_releases_leftovers():
    dev = CudaDevice(0)
    s = dev.create_stream()
    kept = [dev.allocate(1 << 20, stream=s), dev.allocate(1 << 20)]  # noqa: F841 - held, never closed
    h = dev.allocate_host(1 << 20)
    e = s.record()
    assert dev.live().total == 5
    dev.close()
    assert dev.live() == type(dev.live())(0, 0, 0, 1)  # the event we still hold
    del e
    assert dev.live().total == 0
    assert all(b.closed for b in kept)
    dev.close()  # twice: harmless
    with pytest.raises(RuntimeError, match="closed"):
        dev.allocate(10)
    with pytest.raises(RuntimeError, match="closed"):
        h.view()


# -- out of memory ---------------------------------------------------------------------------------------------------
def _twice(x, y):
    y[...] = x * 2


def _round_trip_works(dev):
    """A copy there and back on a fresh stream, buffers and all: the context is not broken."""
    s = dev.create_stream()
    h, d = dev.allocate_host(1 << 20), dev.allocate(1 << 20, stream=s)
    h.view()[:] = 7
    s.copy(d, h)
    s.fill(h, 0)
    s.copy(h, d)
    s.sync()
    assert (h.view() == 7).all()
    d.close(stream=s)
    s.close()
    h.close()


def test_device_memory_the_gpu_has_not_got_is_a_memory_error_and_the_device_stays_usable(cuda_device):
    """CUDA_ERROR_OUT_OF_MEMORY is a MemoryError (what the simulated GPU raises), not only a
    DeviceError, so the pipeline names chunk_bytes for it; and it breaks nothing."""
    from ringflow._errors import DeviceError, OutOfMemoryError

    dev = cuda_device
    too_much = dev.capabilities.total_memory * 2
    for stream in (None, dev.create_stream()):
        with pytest.raises(MemoryError, match=rf"(?s)allocating {too_much} bytes of device memory failed.*"
                                              r"CUDA_ERROR_OUT_OF_MEMORY.*not a broken context") as info:
            dev.allocate(too_much, stream=stream)
        err = info.value
        assert isinstance(err, OutOfMemoryError) and isinstance(err, DeviceError) and not err.sticky
        if stream is not None:
            stream.close()
    _round_trip_works(dev)
    assert dev.live().total == 0, dev.live()


def test_pinned_memory_the_host_has_not_got_is_a_memory_error_and_the_device_stays_usable(cuda_device):
    """More bytes than any host's address space (so the driver refuses at once, pinning nothing)."""
    from ringflow._errors import OutOfMemoryError

    dev = cuda_device
    with pytest.raises(MemoryError, match=r"(?s)pinned host memory failed.*CUDA_ERROR_OUT_OF_MEMORY.*not a broken context") as info:
        dev.allocate_host(1 << 57)
    assert isinstance(info.value, OutOfMemoryError) and not info.value.sticky
    _round_trip_works(dev)
    assert dev.live().total == 0, dev.live()


def test_refused_pinned_memory_frees_the_cached_allocations_first(cuda_device):
    """The cache of closed pinned allocations may be what holds the memory: a refused allocation
    frees it before trying once more (refused even so here: more than any host's address space)."""
    dev = cuda_device
    dev.allocate_host(1 << 20).close()
    assert dev._pinned_cache.take(1 << 20) is not None
    dev.allocate_host(1 << 20).close()
    with pytest.raises(MemoryError, match="pinned host memory failed"):
        dev.allocate_host(1 << 57)
    assert dev._pinned_cache.take(1 << 20) is None
    _round_trip_works(dev)
    assert dev.live().total == 0, dev.live()


def test_refused_device_memory_trims_the_pool_first(cuda_device):
    """The pool keeps freed memory for reuse; a refused allocation gives it back to the GPU
    (after the device's work) before trying once more."""
    from ringflow._device.cuda._lib import check, driver

    dev = cuda_device
    if not dev.capabilities.memory_pools:
        pytest.skip("no stream-ordered memory pool on this GPU")
    drv = driver()

    def reserved() -> int:
        attr = drv.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT
        return int(check(drv.cuMemPoolGetAttribute(dev._device_mr.handle, attr), "cuMemPoolGetAttribute"))

    dev.allocate(256 << 20).close()
    assert reserved() >= 256 << 20  # kept for reuse
    with pytest.raises(MemoryError, match="device memory failed"):
        dev.allocate(dev.capabilities.total_memory * 2)
    assert reserved() < 256 << 20
    _round_trip_works(dev)
    assert dev.live().total == 0, dev.live()


def test_a_pipeline_whose_device_rings_do_not_fit_names_chunk_bytes(cuda_device):
    """With all but a little of the GPU's memory taken (by cuMemAlloc, outside the stream-ordered
    pool, so nothing stays cached in the pool afterwards), the pipeline's device ring does not fit:
    the error names chunk_bytes and the slots, as on the simulated GPU, and nothing is left."""
    from ringflow._device.cuda._lib import check, driver

    dev = cuda_device
    drv = driver()
    dev._ensure_current()
    dev._cc.sync()
    if dev.capabilities.memory_pools:  # memory the pool keeps from earlier frees would serve the rings
        check(drv.cuMemPoolTrimTo(dev._device_mr.handle, 0), "cuMemPoolTrimTo")
    free, _ = check(drv.cuMemGetInfo(), "cuMemGetInfo")
    room = 256 << 20
    hog = check(drv.cuMemAlloc(free - room), "cuMemAlloc")
    chunk = 128 << 20
    try:
        with pytest.raises(MemoryError, match=rf"device-\w+ ring: \d+ slots of chunk_bytes={chunk} bytes.*smaller "
                                              r"chunk_bytes or fewer slots"):
            rf.Pipeline(lambda x, y: None, device=dev, chunk_bytes=chunk, slots=4)
        assert dev.live().total == 0, dev.live()
    finally:
        check(drv.cuMemFree(hog), "cuMemFree")
    with rf.Pipeline(_twice, device=dev, chunk_bytes=chunk, slots=4) as pipe:  # with the memory back, it runs
        assert (pipe.submit(np.ones(1000, np.float32)).result() == 2).all()
    assert dev.live().total == 0, dev.live()


def test_device_buffers_start_on_256_byte_boundaries_and_misaligned_arrays_are_refused(cuda_device):
    """Buffer.array refuses an offset that is no multiple of the dtype's size, trusting that every
    device buffer starts on a 256-byte boundary (CUDA's allocation guarantee); both checked here."""
    dev = cuda_device
    s = dev.create_stream()
    bufs = [dev.allocate(n, stream=s) for n in (1, 7, 1001, 4097)] + [dev.allocate(1001)]
    assert all(b._ptr % 256 == 0 for b in bufs)
    with pytest.raises(ValueError, match="misaligned"):
        bufs[2].array(np.float32, 3, offset=1)
    assert bufs[2].array(np.float32, 3, offset=4).where.offset == 4
    for b in bufs:
        b.close(stream=s)
    s.sync()
    s.close()


@pytest.mark.parametrize("dtype,advice", NOT_DEVICE_DTYPES, ids=NOT_DEVICE_IDS)
@pytest.mark.parametrize("kind", array_kinds())
def test_an_array_of_a_dtype_no_gpu_array_holds_is_refused_as_on_the_simulated_gpu(kind, dtype, advice):
    """The same refusal, in the same words, as the simulated GPU's (tests/device/sim/
    test_bad_input.py): before, CuPy wrapped such memory and failed at the first kernel on it,
    and PyTorch refused the launch's conversion, each with its own error."""
    with CudaDevice(0, array=kind) as dev:
        buf = dev.allocate(256)
        for make in (lambda: buf.array(dtype, 2), lambda: buf.slice(16).array(dtype, 2)):
            with pytest.raises(TypeError, match=r"^array\(dtype\): " + refusal(dtype, advice)):
                make()
        buf.close()
        assert dev.live().total == 0, dev.live()


def test_memory_sharing_a_page_with_pinned_memory_is_pinned_and_only_pinned_bytes_are_refused(cuda_device):
    """The driver refuses to pin bytes pinned already, not a page they share: two arrays side by
    side in one page (numpy's small arrays often are) are each pinned. The simulated GPU refuses
    the same ranges (tests/device/sim/test_host.py)."""
    from ringflow._errors import DeviceError

    check_pinning_within_a_page(cuda_device, DeviceError)
