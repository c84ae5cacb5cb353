"""Host and device buffers on a CUDA GPU.

Lifetimes, and why:

* **Pinned host buffers** come from cuda.core's ``LegacyPinnedMemoryResource``
  (``cuMemAllocHost``). The memory is reached from numpy through a ctypes array that holds
  the cuda.core buffer, so every numpy view keeps the allocation alive: ``close()`` drops the
  buffer's own references and the memory is freed as soon as no view is left. A view kept
  past ``close()`` therefore never points at freed memory (it only delays the free).
* **Pinned memory is recycled** (as CuPy's pinned pool does): closing a pinned buffer that no
  numpy view still references hands its allocation to the device's cache, and the next
  ``allocate_host`` of the same size takes it instead of calling ``cuMemAllocHost`` again
  (allocating and freeing a pipeline's staging ring cost milliseconds per call). Closing a
  buffer that an enqueued copy may still use is a bug either way; the pipeline closes its
  rings only after every fence completed, and the simulated GPU's checker catches the bug.
  When ``cuMemAllocHost`` finds no memory, the cache is freed and the allocation tried once
  more: the cache may be what holds the memory.
* **Registered host buffers** pin the caller's numpy array in place (``cuMemHostRegister``,
  through cuda.bindings: cuda.core has no call for it). The buffer holds the array, so the
  array outlives the registration; ``close()`` (or collection) unregisters it.
* **Device buffers** come from the device's stream-ordered pool (``cuMemAllocAsync`` via
  cuda.core's ``DeviceMemoryResource``). ``close(stream)`` frees in that stream's order; the
  caller must have ordered every other stream's use before it. ``close()`` with no stream
  waits for all work on the device first, so it is always safe (and blocking). The pool keeps
  freed memory for reuse; when an allocation finds no memory, the device's work is waited for,
  the pool trimmed to what is in use and the allocation tried once more.
"""

from __future__ import annotations

import ctypes
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..._errors import OutOfMemoryError
from ..protocol import ArrayArg, DeviceBuffer, HostBuffer, check_nbytes, typed_view
from ._lib import check, core, driver, translate

if TYPE_CHECKING:
    from .device import CudaDevice
    from .stream import CudaStream


class _CudaHostBuffer(HostBuffer):
    """Common part of pinned and registered host memory: a pointer and a numpy byte view."""

    def __init__(self, device: "CudaDevice", nbytes: int, ptr: int, base: np.ndarray):
        super().__init__(nbytes)
        self._device = device
        self._ptr = ptr
        self._base: np.ndarray | None = base  # 1-D uint8 over the whole allocation

    @property
    def owner(self) -> "CudaDevice":
        return self._device

    @property
    def ptr(self) -> int:
        """Address of the first byte (valid on the host and, with unified addressing, the device)."""
        self._check_open()
        return self._ptr

    def _memory(self) -> np.ndarray:
        return self._base

    def view(self, dtype: Any = np.uint8, *, offset: int = 0, count: int | None = None,
             access: str = "rw") -> np.ndarray:
        """A numpy view of the bytes (``access="r"`` makes it read-only). Nothing checks it
        against device work here: order host access after the events that hand the buffer over."""
        self._check_open()
        return typed_view(self._base, dtype, offset, count, access)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._base = None
        self._device._live.forget(self)
        self._finalizer()  # uncount; unregisters registered memory

    def __repr__(self) -> str:
        kind = "registered" if self.registered else "pinned"
        state = " closed" if self._closed else ""
        return f"<CudaHostBuffer {kind} {self.nbytes} B at {self._ptr:#x}{state}>"


class PinnedHostBuffer(_CudaHostBuffer):
    """Page-locked memory from ``cuMemAllocHost``; freed once closed and no numpy view is left."""

    registered = False

    def __init__(self, device: "CudaDevice", nbytes: int):
        nbytes = check_nbytes(nbytes, "allocate_host(nbytes)")
        base = device._pinned_cache.take(nbytes)
        if base is None:
            device._ensure_current()
            cc_buf = _allocate_or_free_and_retry(lambda: device._pinned_mr.allocate(nbytes),
                                                 device._pinned_cache.clear,
                                                 f"allocating {nbytes} bytes of pinned host memory")
            raw = (ctypes.c_uint8 * nbytes).from_address(int(cc_buf.handle))
            raw._ringflow_owner = cc_buf  # every numpy view -> raw -> cc_buf: the memory outlives its views
            base = np.frombuffer(raw, dtype=np.uint8)
        super().__init__(device, nbytes, int(base.ctypes.data), base)
        self._finalizer = device._live.track(self, "host_buffers")

    def close(self) -> None:
        base = self._base
        super().close()
        # recycle only when no numpy view is left (this frame's reference and getrefcount's)
        if base is not None and sys.getrefcount(base) <= 2:
            self._device._pinned_cache.give(base)


class PinnedCache:
    """Closed pinned allocations by size, up to ``limit`` bytes in all; cleared on device close."""

    def __init__(self, limit: int = 4 << 30):
        self.limit = limit
        self._free: dict[int, list[np.ndarray]] = {}
        self._bytes = 0

    def take(self, nbytes: int) -> "np.ndarray | None":
        bucket = self._free.get(nbytes)
        if not bucket:
            return None
        self._bytes -= nbytes
        return bucket.pop()

    def give(self, base: np.ndarray) -> None:
        if self._bytes + base.nbytes > self.limit:
            return  # dropping the last reference frees it
        self._free.setdefault(base.nbytes, []).append(base)
        self._bytes += base.nbytes

    def clear(self) -> int:
        """Drop every cached allocation (each is freed with its last reference, held here);
        returns the bytes dropped."""
        dropped = self._bytes
        self._free.clear()
        self._bytes = 0
        return dropped


class RegisteredHostBuffer(_CudaHostBuffer):
    """An existing numpy array pinned in place; closing (or collection) unregisters it."""

    registered = True

    def __init__(self, device: "CudaDevice", array: np.ndarray):
        if not isinstance(array, np.ndarray):
            raise TypeError(f"register_host needs a numpy array, got {type(array).__name__}")
        if not array.flags.c_contiguous:
            raise ValueError("register_host needs a C-contiguous array; pass np.ascontiguousarray(a) "
                             "(a copy) or register the contiguous base array")
        if array.dtype.hasobject:
            raise TypeError("register_host cannot pin an array of Python objects")
        nbytes = check_nbytes(array.nbytes, "register_host(array).nbytes")
        device._ensure_current()
        drv = driver()
        ptr = int(array.ctypes.data)
        flags = drv.CU_MEMHOSTREGISTER_PORTABLE
        if not array.flags.writeable and device._read_only_register:
            flags |= drv.CU_MEMHOSTREGISTER_READ_ONLY
        # cuda.core has no host-registration call: cuMemHostRegister through cuda.bindings.
        check(drv.cuMemHostRegister(ptr, nbytes, flags),
              f"cuMemHostRegister of {nbytes} bytes at {ptr:#x} (is it registered already?)")
        super().__init__(device, nbytes, ptr, array.reshape(-1).view(np.uint8))
        self.array = array
        # The finalizer holds the array, so the memory stays valid until it is unregistered.
        self._finalizer = device._live.track(self, "host_buffers",
                                             cleanup=_Unregister(device.index, ptr, array))


class _Unregister:
    """Unregisters host memory; also run by the garbage collector, so it sets the context."""

    def __init__(self, index: int, ptr: int, array: np.ndarray):
        self.index, self.ptr, self.array = index, ptr, array

    def __call__(self) -> None:
        core().Device(self.index).set_current()
        check(driver().cuMemHostUnregister(self.ptr), f"cuMemHostUnregister at {self.ptr:#x}")
        self.array = None


def _allocate_or_free_and_retry(allocate: Callable[[], Any], free: Callable[[], Any], what: str) -> Any:
    """``allocate()``; where there is no memory for it, ``free()`` the memory kept for reuse and,
    if that freed any (a true result), ``allocate()`` once more. A last refusal is followed by
    ``free()`` again: a refused allocation may leave what it gathered toward the request kept for
    reuse (a stream-ordered pool does), which would starve every allocation outside it.

    Raises:
        OutOfMemoryError: no memory even so (the last attempt's error, naming ``what``).
        DeviceError: any other failure, at once.
    """
    try:
        with translate(what):
            return allocate()
    except OutOfMemoryError:
        if not free():
            raise
    # outside the except clause: a second refusal is raised alone, not chained to the first
    try:
        with translate(what):
            return allocate()
    except OutOfMemoryError:
        try:
            free()
        except Exception:  # noqa: BLE001 - the refusal is the caller's error; this clean-up never masks it
            pass
        raise


def _trim_pool(device: "CudaDevice") -> bool:
    """Give the device pool's unused memory back to the GPU (the pool keeps what is freed, see
    ``_POOL_RELEASE_THRESHOLD``); False where nothing was done.

    A pool trims only the frees it has seen complete, so the device's work is waited for first.
    Nothing is done without a stream-ordered pool (synchronous ``cuMemAlloc`` keeps nothing) or
    while a stream of this device is capturing (a device synchronisation would invalidate it).
    """
    if not device.capabilities.memory_pools or device._capturing:
        return False
    with translate("synchronising the device before trimming its memory pool"):
        device._cc.sync()
    # cuda.core has no trim call: cuMemPoolTrimTo from cuda.bindings
    check(driver().cuMemPoolTrimTo(device._device_mr.handle, 0), "cuMemPoolTrimTo")
    return True


class CudaDeviceBuffer(DeviceBuffer):
    """Device memory from the stream-ordered pool."""

    def __init__(self, device: "CudaDevice", nbytes: int, stream: "CudaStream | None"):
        nbytes = check_nbytes(nbytes, "allocate(nbytes)")
        super().__init__(nbytes)
        device._ensure_current()
        cc_stream = stream._cc if stream is not None else device._internal_stream
        self._cc = _allocate_or_free_and_retry(lambda: device._device_mr.allocate(nbytes, stream=cc_stream),
                                               lambda: _trim_pool(device),
                                               f"allocating {nbytes} bytes of device memory")
        if stream is None:
            # Allocated in the internal stream's order: wait so any stream may use it at once.
            with translate("synchronising the allocation stream"):
                device._internal_stream.sync()
        self._device = device
        self._ptr = int(self._cc.handle)
        self._finalizer = device._live.track(self, "device_buffers")

    @property
    def owner(self) -> "CudaDevice":
        return self._device

    @property
    def ptr(self) -> int:
        self._check_open()
        return self._ptr

    def array(self, dtype: Any, shape: "Sequence[int] | int", offset: int = 0) -> ArrayArg:
        """:meth:`Buffer.array <ringflow._device.protocol.Buffer.array>`, also refusing a dtype the
        device's array type cannot hold (PyTorch without unsigned 16-, 32- and 64-bit tensors):
        here, rather than in the launch that would hand the compute the array."""
        arg = super().array(dtype, shape, offset)
        self._device._adapter.check_dtype("array(dtype)", arg.dtype)
        return arg

    def close(self, stream: "CudaStream | None" = None) -> None:
        """Free the memory. With ``stream``: after the work already enqueued there (the caller
        ordered other streams' use before it). Without: after all work on the device."""
        if self._closed:
            return
        if stream is not None:
            self._device._check_stream(stream)
        self._closed = True
        dev = self._device
        try:
            dev._ensure_current()
            if stream is not None:
                self._cc.close(stream._cc)
            else:
                dev._cc.sync()
                self._cc.close(dev._internal_stream)
        except Exception as exc:  # noqa: BLE001 - cleanup never raises
            warnings.warn(f"freeing {self!r} failed: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
        finally:
            self._cc = None
            dev._live.forget(self)
            self._finalizer()

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<CudaDeviceBuffer {self.nbytes} B at {self._ptr:#x} on cuda:{self._device.index}{state}>"
