"""CPU tests: an allocation the CUDA backend finds no memory for frees what the backend keeps
for reuse and tries once more, with cuda.core's and cuda.bindings' calls stood in for."""

from __future__ import annotations

import ctypes
import gc
import types
import weakref

import pytest

from ringflow._device.cuda import _lib, memory
from ringflow._device.cuda._live import LiveRegistry
from ringflow._device.cuda.memory import CudaDeviceBuffer, PinnedCache, PinnedHostBuffer
from ringflow._errors import DeviceError, OutOfMemoryError

NO_MEMORY = "CUDA_ERROR_OUT_OF_MEMORY: out of memory"


@pytest.fixture(autouse=True)
def cuda_errors(monkeypatch):
    """cuda.core's error type, stood in for by RuntimeError (as translate() sees it)."""
    monkeypatch.setattr(_lib, "cuda_errors", lambda: (RuntimeError,))


class Memory:
    """An allocation as cuda.core returns it: ``handle`` is its address."""

    def __init__(self, nbytes: int):
        self._bytes = (ctypes.c_uint8 * nbytes)()
        self.handle = ctypes.addressof(self._bytes)

    def close(self, stream=None):
        pass


class Resource:
    """A memory resource that refuses the next ``refuse`` requests with ``error``."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name
        self.refuse = 0
        self.error = NO_MEMORY
        self.handle = 0xB001

    def allocate(self, nbytes, stream=None):
        self.log.append(f"{self.name} {nbytes}")
        if self.refuse:
            self.refuse -= 1
            raise RuntimeError(self.error)
        return Memory(nbytes)


class Sync:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def sync(self):
        self.log.append(self.name)


class FakeDevice:
    """What the buffers use of a CudaDevice, with a log of the calls they make."""

    def __init__(self, memory_pools: bool = True):
        self.log: list[str] = []
        self._live = LiveRegistry()
        self._pinned_cache = PinnedCache()
        self._pinned_mr = Resource(self.log, "cuMemAllocHost")
        self._device_mr = Resource(self.log, "cuMemAllocAsync")
        self._internal_stream = Sync(self.log, "internal stream sync")
        self._cc = Sync(self.log, "device sync")
        self._capturing: set = set()
        self.capabilities = types.SimpleNamespace(memory_pools=memory_pools)
        self.index = 0

    def _ensure_current(self):
        pass


@pytest.fixture
def trims(monkeypatch):
    """cuda.bindings' driver, only its cuMemPoolTrimTo, which logs its arguments."""
    calls = []

    def trim(pool, keep):
        calls.append((pool, keep))
        return (0,)

    monkeypatch.setattr(memory, "driver", lambda: types.SimpleNamespace(cuMemPoolTrimTo=trim))
    return calls


def cached_block(dev: FakeDevice, nbytes: int) -> weakref.ref:
    """Close a pinned buffer of ``nbytes`` into the device's cache; a reference to its memory."""
    buf = PinnedHostBuffer(dev, nbytes)
    raw = weakref.ref(buf._base.base._ringflow_owner)  # base -> ctypes array -> allocation
    buf.close()
    assert raw() is not None and dev._pinned_cache.take(nbytes + 1) is None
    return raw


def test_pinned_memory_refused_frees_the_cached_blocks_and_tries_once_more():
    dev = FakeDevice()
    raw = cached_block(dev, 4096)
    dev.log.clear()
    dev._pinned_mr.refuse = 1
    buf = PinnedHostBuffer(dev, 8192)
    assert dev.log == ["cuMemAllocHost 8192", "cuMemAllocHost 8192"]
    gc.collect()
    assert raw() is None  # the cached block's memory was freed, not only forgotten
    assert dev._pinned_cache.take(4096) is None
    assert buf.nbytes == 8192 and dev._live.counts().host_buffers == 1
    buf.close()


def test_pinned_memory_refused_twice_raises_the_out_of_memory_alone():
    dev = FakeDevice()
    cached_block(dev, 4096)
    dev.log.clear()
    dev._pinned_mr.refuse = 2
    with pytest.raises(OutOfMemoryError, match="allocating 8192 bytes of pinned host memory failed") as info:
        PinnedHostBuffer(dev, 8192)
    assert dev.log == ["cuMemAllocHost 8192", "cuMemAllocHost 8192"]
    assert info.value.__context__ is None or info.value.__context__ is info.value.__cause__  # not the first refusal
    assert dev._live.counts().host_buffers == 0


def test_pinned_memory_refused_with_nothing_cached_is_not_asked_again():
    dev = FakeDevice()
    dev._pinned_mr.refuse = 1
    with pytest.raises(OutOfMemoryError):
        PinnedHostBuffer(dev, 8192)
    assert dev.log == ["cuMemAllocHost 8192"]


def test_another_pinned_memory_error_keeps_the_cache():
    dev = FakeDevice()
    cached_block(dev, 4096)
    dev.log.clear()
    dev._pinned_mr.refuse, dev._pinned_mr.error = 1, "CUDA_ERROR_INVALID_VALUE: invalid argument"
    with pytest.raises(DeviceError) as info:
        PinnedHostBuffer(dev, 8192)
    assert not isinstance(info.value, MemoryError) and dev.log == ["cuMemAllocHost 8192"]
    assert dev._pinned_cache.take(4096) is not None


def test_device_memory_refused_trims_the_pool_after_the_device_work_and_tries_once_more(trims):
    dev = FakeDevice()
    dev._device_mr.refuse = 1
    buf = CudaDeviceBuffer(dev, 8192, None)
    # the pool can give back only frees the device has completed: wait for the device first
    assert dev.log == ["cuMemAllocAsync 8192", "device sync", "cuMemAllocAsync 8192", "internal stream sync"]
    assert trims == [(dev._device_mr.handle, 0)]
    assert dev._live.counts().device_buffers == 1
    del buf


def test_device_memory_refused_twice_raises_the_out_of_memory_and_holds_nothing(trims):
    """A refused allocation can leave the pool holding what it gathered toward the request (on an
    H200, nearly all of the device's memory after asking for twice of it): the pool is trimmed
    again after the last refusal, so memory outside the pool is not starved by it."""
    dev = FakeDevice()
    dev._device_mr.refuse = 2
    with pytest.raises(OutOfMemoryError, match="allocating 8192 bytes of device memory failed"):
        CudaDeviceBuffer(dev, 8192, None)
    assert dev.log == ["cuMemAllocAsync 8192", "device sync", "cuMemAllocAsync 8192", "device sync"]
    assert len(trims) == 2
    assert dev._live.counts().device_buffers == 0


def test_a_failed_trim_after_the_last_refusal_does_not_mask_it(trims, monkeypatch):
    from ringflow._device.cuda import memory

    dev = FakeDevice()
    dev._device_mr.refuse = 2
    calls = []

    def trim(device):
        calls.append(device)
        if len(calls) == 2:
            raise DeviceError("synchronising the device failed")
        return True

    monkeypatch.setattr(memory, "_trim_pool", trim)
    with pytest.raises(OutOfMemoryError, match="allocating 8192 bytes of device memory failed"):
        CudaDeviceBuffer(dev, 8192, None)
    assert len(calls) == 2


@pytest.mark.parametrize("why", ["no stream-ordered pool", "a capture in progress"])
def test_device_memory_refused_is_not_asked_again_where_the_pool_cannot_be_trimmed(trims, why):
    """Without a pool (synchronous cuMemAlloc) nothing is kept; during a capture a device
    synchronisation would break the capture."""
    dev = FakeDevice(memory_pools=why != "no stream-ordered pool")
    if why == "a capture in progress":
        dev._capturing.add(1)
    dev._device_mr.refuse = 1
    with pytest.raises(OutOfMemoryError):
        CudaDeviceBuffer(dev, 8192, None)
    assert dev.log == ["cuMemAllocAsync 8192"] and trims == []
