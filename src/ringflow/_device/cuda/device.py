"""``CudaDevice``: one NVIDIA GPU through cuda.core (the primary context of that GPU).

Threads: every entry point makes the device's primary context current on the calling thread
first (once per thread), so streams, buffers and events may be used from any thread,
including worker-pool threads. CuPy and PyTorch use the same primary context.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
import weakref
from typing import Any, Optional, Sequence

import numpy as np

from ..._checks import check_wait_timeout
from ..host_pool import without_pooled
from ..protocol import (BufferSlice, Capabilities, Device, DeviceBuffer, LiveCounts, check_device_dtype, check_own_stream,
                        check_priority, close_quietly)
from ._lib import check, core, driver, translate
from ._live import LiveRegistry
from .arrays import resolve
from .memory import CudaDeviceBuffer, PinnedCache, PinnedHostBuffer, RegisteredHostBuffer
from .pool import CudaHostTask, ThreadWorkerPool, WorkerThreads
from .probe import probe
from .stream import CudaStream

# Keep the pool's freed memory instead of returning it to the OS at every synchronisation.
_POOL_RELEASE_THRESHOLD = (1 << 64) - 1
_WAIT_SPIN_S = 0.005  # wait_any first polls with a yield between polls for this long ...
_WAIT_FIRST_SLEEP_S = 20e-6  # ... then sleeps, from this ...
_WAIT_MAX_SLEEP_S = 200e-6   # ... to this, so a completion is seen within ~0.2 ms
_IDLE_STREAMS_MAX = 16  # closed streams kept per priority for reuse


_THREAD = threading.local()  # .current: the index of the GPU whose context is current on this thread



_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged


def _cuda_dlpack(obj: Any) -> Any:
    """A DLPack producer on a CUDA device as an array with ``__cuda_array_interface__`` (CuPy's,
    else PyTorch's ``from_dlpack``), None for anything else.

    Raises:
        TypeError: neither CuPy nor PyTorch can import it.
    """
    if not (hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__")):
        return None
    try:
        kind = int(obj.__dlpack_device__()[0])
    except Exception:  # noqa: BLE001 - a producer that cannot say where it lives is not a device array
        return None
    if kind not in _DLPACK_CUDA:
        return None
    try:
        import cupy

        return cupy.from_dlpack(obj)
    except ImportError:
        pass
    try:
        import torch

        return torch.from_dlpack(obj)
    except ImportError:
        raise TypeError(f"a {type(obj).__name__} on a CUDA device (DLPack) needs CuPy or PyTorch to be read in "
                        "place; install one, or pass a CuPy array or a torch tensor") from None

class CudaDevice(Device):
    """GPU ``index`` as a ringflow device. ``array`` picks what launched callables receive:
    ``"cupy"``, ``"torch"``, ``"dlpack"`` or ``"auto"`` (CuPy, else PyTorch, else DLPack)."""

    backend = "cuda"

    def __init__(self, index: int = 0, array: str = "auto"):
        ok, reason = probe()
        if not ok:
            raise RuntimeError(f"no usable CUDA GPU: {reason}. Use ringflow.device('sim') instead")
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"GPU index must be an int, got {type(index).__name__}")
        cc = core()
        count = len(cc.Device.get_all_devices())
        if not 0 <= index < count:
            raise ValueError(f"there is no cuda:{index}; this machine has {count} GPU(s): use cuda:0..cuda:{count - 1}")
        self.index = index
        self._tls = threading.local()
        self._closed = False
        self._live = LiveRegistry()
        self._capturing: set = set()  # threads with a capture in progress here (one each)
        self._timing_floor: Optional[float] = None  # measured on first use (timing_floor)
        self._pools: "weakref.WeakSet[ThreadWorkerPool]" = weakref.WeakSet()
        # set by any host task of this device finishing (after its future is done): wait_any
        # waits on this one flag instead of registering a waiter on every pending future
        self._host_task_done = threading.Event()
        self._threads = WorkerThreads()  # lent to one pool at a time
        self._pinned_cache = PinnedCache()
        # untimed CUDA events whose CudaEvent was collected, re-recorded by the next record()
        # (list append/pop are atomic under the GIL, so any thread may give or take)
        self._idle_events: list[Any] = []
        # closed streams by priority, oldest first; reused once idle (see _take_idle_stream)
        self._idle_streams: dict[int, list[Any]] = {}
        self._cc = cc.Device(index)
        self._ensure_current()
        self.name = self._cc.name
        self._adapter = resolve(array)
        self.array_type = self._adapter.name
        self._caps: Capabilities | None = None
        props = self._cc.properties
        self._read_only_register = bool(props.read_only_host_register_supported)
        with translate("setting up cuda:%d" % index):
            # An internal stream (not counted as live) orders allocate()/close() without a stream.
            self._internal_stream = self._cc.create_stream(options=cc.StreamOptions(nonblocking=True))
            self._pinned_mr = cc.LegacyPinnedMemoryResource()
            if props.memory_pools_supported:
                self._device_mr = cc.DeviceMemoryResource(index)  # the device's current pool
                self._keep_pool_memory()
            else:
                self._device_mr = self._cc.memory_resource  # synchronous cuMemAlloc fallback

    # -- internals -----------------------------------------------------------------------------
    def _take_idle_stream(self, priority: int) -> Any:
        """A closed stream of ``priority`` with nothing left to run, or None. A stream still
        running a closed owner's work is never handed on: the new owner's work would queue
        behind it."""
        idle = self._idle_streams.get(priority)
        if not idle:
            return None
        drv = driver()
        for i, cc_stream in enumerate(idle):
            # cuda.core has no stream query: cuStreamQuery from cuda.bindings
            (err,) = drv.cuStreamQuery(cc_stream.handle)
            if err == drv.CUresult.CUDA_SUCCESS:
                return idle.pop(i)
        return None

    def _recycle_stream(self, cc_stream: Any, priority: int) -> bool:
        """Keep a closed stream for reuse; False when the caller should destroy it instead."""
        if self._closed:
            return False
        idle = self._idle_streams.setdefault(priority, [])
        if len(idle) >= _IDLE_STREAMS_MAX:
            return False
        idle.append(cc_stream)
        return True

    def _ensure_current(self) -> None:
        # the current context is the thread's, shared by every device object: another GPU's calls
        # on this thread change it, so remember which GPU made it current, not whether this one did
        if getattr(_THREAD, "current", None) != self.index:
            core().Device(self.index).set_current()  # cuda.core Device objects are per thread
            _THREAD.current = self.index

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed; create a new device with ringflow.device(...)")

    def _check_stream(self, stream: Any) -> CudaStream:
        if not isinstance(stream, CudaStream) or stream._device is not self:
            raise TypeError(f"expected a stream created by {self!r}, got {stream!r}")
        stream._check_open()
        return stream

    def _keep_pool_memory(self) -> None:
        drv = driver()
        try:
            # cuda.core exposes the pool's attributes read-only: set the threshold via cuda.bindings.
            check(drv.cuMemPoolSetAttribute(self._device_mr.handle,
                                            drv.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                            drv.cuuint64_t(_POOL_RELEASE_THRESHOLD)),
                  "cuMemPoolSetAttribute(RELEASE_THRESHOLD)")
        except Exception as exc:  # noqa: BLE001 - only a performance hint
            warnings.warn(f"could not keep freed pool memory cached: {exc}", RuntimeWarning, stacklevel=2)

    # -- protocol ------------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        if self._caps is None:
            self._ensure_current()
            p = self._cc.properties
            drv = driver()
            least, greatest = check(drv.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
            # cuda.core has no total-memory query: cuDeviceTotalMem from cuda.bindings.
            total = check(drv.cuDeviceTotalMem(self.index), "cuDeviceTotalMem")
            cap = self._cc.compute_capability
            self._caps = Capabilities(
                name=self.name, backend="cuda", compute_capability=(int(cap.major), int(cap.minor)),
                sm_count=int(p.multiprocessor_count), async_engine_count=int(p.async_engine_count),
                concurrent_kernels=bool(p.concurrent_kernels), memory_pools=bool(p.memory_pools_supported),
                stream_priorities=(int(least), int(greatest)), host_register=bool(p.host_register_supported),
                unified_addressing=bool(p.unified_addressing), total_memory=int(total))
        return self._caps

    @property
    def now(self) -> float:
        return time.perf_counter()

    def create_stream(self, priority: int = 0) -> CudaStream:
        """A non-blocking stream; lower ``priority`` numbers run first when streams compete.
        A priority outside ``capabilities.stream_priorities`` raises ValueError (as on the sim)."""
        self._check_open()
        return CudaStream(self, check_priority(priority, self.capabilities))

    def allocate_host(self, nbytes: int) -> PinnedHostBuffer:
        self._check_open()
        return PinnedHostBuffer(self, nbytes)

    def register_host(self, array: np.ndarray) -> RegisteredHostBuffer:
        self._check_open()
        return RegisteredHostBuffer(self, array)

    def allocate(self, nbytes: int, stream: CudaStream | None = None) -> CudaDeviceBuffer:
        """Device memory from the stream-ordered pool. With ``stream`` it is usable there at once
        and on other streams once ordered after it; without, it is usable everywhere (the
        allocation is waited for)."""
        self._check_open()
        if stream is not None:
            self._check_stream(stream)
        return CudaDeviceBuffer(self, nbytes, stream)

    def create_worker_pool(self, workers: int) -> ThreadWorkerPool:
        self._check_open()
        pool = ThreadWorkerPool(workers, self._threads, on_close=self._pools.discard,
                                on_task_done=self._host_task_done.set)
        self._pools.add(pool)
        return pool

    def wait_any(self, waitables: Sequence[Any], timeout: float | None = None,
                 wake: "threading.Event | None" = None) -> list[Any]:
        """Block until at least one event / host task is done or ``timeout`` seconds pass;
        return those done (empty on timeout). An event that hit a sticky device error counts
        as done (its ``error`` is set).

        Completions are polled: first for ``_WAIT_SPIN_S`` with a GIL-releasing yield between
        polls (a pipeline hands off every few hundred microseconds, and a sleeping poller adds
        its sleep to every hand-off: docs/design.md, "Calibration notes"), then with sleeps
        growing from 20 us to 200 us so an idle wait does not burn a core."""
        waitables = list(waitables)
        if not waitables:
            raise ValueError("wait_any needs at least one event or host task to wait for")
        for w in waitables:
            if not hasattr(w, "is_done"):
                raise TypeError(f"wait_any waits for events and host tasks, got {type(w).__name__}")
        if timeout is not None and not (type(timeout) is float and 0.0 <= timeout < math.inf):
            # the driver's float timeouts pass the first test: the full check is for the rest
            timeout = check_wait_timeout(timeout)
        now = time.perf_counter
        start = now()
        deadline = None if timeout is None else start + timeout
        delay = _WAIT_FIRST_SLEEP_S
        # with host tasks among them, block for a moment on the device's task-done flag instead
        # of yielding: a yield per poll makes 16 busy copy workers hand the GIL back and forth
        # needlessly. The flag is cleared before each poll, so a task finishing after the poll
        # sets it and the wait returns at once.
        tasks = any(isinstance(w, CudaHostTask) for w in waitables)
        flag = self._host_task_done
        while True:
            if tasks:
                flag.clear()
            done = [w for w in waitables if w.is_done]
            if done or (wake is not None and wake.is_set()):
                return done
            t = now()
            if deadline is not None and t >= deadline:
                return []
            if t - start < _WAIT_SPIN_S:
                if tasks:
                    flag.wait(_WAIT_FIRST_SLEEP_S)
                else:
                    time.sleep(0)  # yield the GIL to the workers, then poll again
                continue
            step = delay if deadline is None else min(delay, deadline - t)
            if wake is not None:
                wake.wait(max(0.0, step))  # a sleep that new work cuts short
            else:
                time.sleep(max(0.0, step))
            delay = min(delay * 2, _WAIT_MAX_SLEEP_S)

    def timing_floor(self, stream: Any) -> float:
        """Measured once per device (the least of a few back-to-back pairs of timing events on
        ``stream``, an idle stream being the caller's to give) and kept."""
        floor = self._timing_floor
        if floor is None:
            gaps = []
            for _ in range(5):
                a = stream.record(timing=True)
                b = stream.record(timing=True)
                b.sync()
                gaps.append(b.elapsed_since(a))
            floor = self._timing_floor = max(0.0, min(gaps))
        return floor

    def record_on(self, stream: Any) -> Any:
        """An event on ``stream``: one of this device's streams; a foreign stream given by the
        CUDA stream protocol (``__cuda_stream__``), PyTorch's ``cuda_stream`` or CuPy's ``ptr``;
        or None for the legacy default stream (where CuPy and PyTorch put work unless told
        otherwise, and which every blocking stream of the context is ordered with).

        Raises:
            TypeError: ``stream`` is none of these.
        """
        from .stream import CudaEvent, CudaStream, _event_options

        if isinstance(stream, CudaStream):
            return check_own_stream(self, stream).record()
        if stream is None:
            handle = 0
        elif isinstance(stream, int) and not isinstance(stream, bool):  # a raw handle (__cuda_array_interface__'s)
            handle = 0 if stream == 1 else stream  # 1: the legacy default stream's special handle
        elif hasattr(stream, "__cuda_stream__"):
            handle = int(stream.__cuda_stream__()[1])
        elif hasattr(stream, "cuda_stream"):
            handle = int(stream.cuda_stream)
        elif hasattr(stream, "ptr"):
            handle = int(stream.ptr)
        else:
            raise TypeError(f"stream must be a CUDA stream (an object with __cuda_stream__, a torch.cuda.Stream, a "
                            f"cupy.cuda.Stream or one of {self!r}'s streams) or None, got {type(stream).__name__}")
        self._ensure_current()
        cc = core()
        foreign = getattr(cc, "LEGACY_DEFAULT_STREAM", None) if handle == 0 else None
        if foreign is None:
            foreign = cc.Stream.from_handle(handle)
        with translate(lambda: f"recording an event on stream {handle:#x}"):
            ev = foreign.record(options=_event_options(False))
        return CudaEvent(self, ev, False, _Foreign(handle))

    def device_source(self, obj: Any) -> "tuple | None":
        """A C-contiguous array with ``__cuda_array_interface__`` (CuPy, a torch CUDA tensor), or
        a DLPack producer on a CUDA device (imported through CuPy or PyTorch, which ask the
        producer to order its data before their current stream), in this GPU's memory:
        ``(BufferSlice, shape, dtype, producer stream handle or None)``, read in place by the copy
        engine; None for anything else.

        Raises:
            ValueError: a device array of another GPU, or not C-contiguous.
            TypeError: a CUDA DLPack producer with neither CuPy nor PyTorch installed to import it.
        """
        cai = getattr(obj, "__cuda_array_interface__", None)
        if not isinstance(cai, dict):
            imported = _cuda_dlpack(obj)
            if imported is None:
                return None
            return self.device_source(imported)  # the buffer holds the imported array, which holds obj
        return self._cai_source(obj, cai)

    def _cai_source(self, obj: Any, cai: dict) -> tuple:
        """:meth:`device_source` of an array with ``__cuda_array_interface__`` ``cai``."""
        shape = tuple(int(d) for d in cai["shape"])
        dtype = np.dtype(cai["typestr"])
        strides = cai.get("strides")
        if strides is not None and tuple(strides) != tuple(np.empty(shape, dtype).strides):
            raise ValueError(f"a device array item must be C-contiguous (got strides {tuple(strides)} for shape "
                             f"{shape}); pass a contiguous copy (e.g. cupy.ascontiguousarray)")
        ptr = int(cai["data"][0])
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if nbytes:
            self._ensure_current()
            attr = driver().CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
            ordinal = int(check(driver().cuPointerGetAttribute(attr, ptr), "cuPointerGetAttribute"))
            if ordinal != self.index:
                raise ValueError(f"a device array item is on cuda:{ordinal}, not on {self!r}; copy it there first")
        buffer = ForeignDeviceBuffer(self, ptr, nbytes, obj)
        return BufferSlice(buffer, 0, nbytes), shape, dtype, cai.get("stream")

    def check_dtype(self, name: str, dtype: np.dtype) -> None:
        """:meth:`Device.check_dtype <ringflow._device.protocol.Device.check_dtype>`, narrowed to
        what this device's array type holds (``array="torch"``: this PyTorch's tensor types)."""
        check_device_dtype(name, dtype)
        self._adapter.check_dtype(name, dtype)

    def device_array(self, arg: Any) -> Any:
        """``arg`` as an array of this device's framework (CuPy, PyTorch or DLPack)."""
        self._ensure_current()
        return self._adapter.array(arg, self.index)

    def live(self) -> LiveCounts:
        return without_pooled(self, self._live.counts())

    def close(self) -> None:
        """Wait for the device's work, then close every buffer, stream and worker pool still
        open, then run the :meth:`on_close` callbacks. Harmless twice: a later close runs the
        callbacks a Ctrl-C left, or waits for another thread's close to have run them. Failures
        become warnings."""
        if self._closed:
            self._run_close_callbacks()
            return
        try:
            self._ensure_current()
            self._cc.sync()
        except Exception as exc:  # noqa: BLE001 - cleanup never raises
            warnings.warn(f"synchronising {self!r} before closing failed: {exc}", RuntimeWarning, stacklevel=2)
        for pool in list(self._pools):
            close_quietly(pool, "a worker pool")
        self._threads.shutdown()
        self._pinned_cache.clear()
        leftovers = self._live.open_objects()
        # Buffers first (their stream-ordered frees use the internal stream), then streams.
        for obj in sorted(leftovers, key=lambda o: isinstance(o, CudaStream)):
            close_quietly(obj, repr(obj))
        self._closed = True  # from here closed streams and collected events are destroyed, not kept
        idle, self._idle_events = self._idle_events, []
        for streams in self._idle_streams.values():
            idle.extend(streams)
        self._idle_streams = {}
        for cc_object in idle:
            try:
                cc_object.close()
            except Exception:  # noqa: BLE001 - cleanup never raises; the context goes with the process
                pass
        try:
            self._internal_stream.close()
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"closing the internal stream failed: {exc}", RuntimeWarning, stacklevel=2)
        self._run_close_callbacks()

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<CudaDevice cuda:{self.index} {getattr(self, 'name', '?')}{state}>"


class ForeignDeviceBuffer(DeviceBuffer):
    """Device memory ringflow did not allocate (a framework's array), named for copies only:
    it keeps ``owner`` alive and never frees anything."""

    def __init__(self, device: "CudaDevice", ptr: int, nbytes: int, owner: Any):
        super().__init__(nbytes)
        self._device = device
        self._ptr = ptr
        self._owner = owner

    @property
    def owner(self) -> "CudaDevice":
        """The device the memory is on (``_owner`` is the framework's array that holds it)."""
        return self._device

    def close(self, stream: Any = None) -> None:
        self._closed = True
        self._owner = None

    def __repr__(self) -> str:
        return f"<device array at {self._ptr:#x}, {self.nbytes} B>"


class _Foreign:
    """Names a stream ringflow did not make, for an event's repr."""

    def __init__(self, handle: int):
        self.handle = handle

    def __repr__(self) -> str:
        return f"<stream {self.handle:#x}>"
