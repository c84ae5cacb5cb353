"""The device seam: the few primitives a backend implements.

Names follow NVIDIA's cuda.core. Everything above this layer (the pipeline, the planner, the
tracer) talks to a device only through these classes, so the same pipeline runs on the real
GPU (``ringflow._device.cuda``) and on the simulated one (``ringflow._device.sim``).

Ordering facts every backend keeps:

* Operations enqueued on one :class:`Stream` run in enqueue order; operations on different
  streams are unordered unless a :meth:`Stream.wait` orders them.
* Enqueueing returns at once. Data written by an operation is valid only after an event
  recorded after it has completed; the host learns that only from :attr:`Event.is_done`,
  :meth:`Event.sync` or :meth:`Device.wait_any`, never from elapsed time.
* A host task (:meth:`WorkerPool.submit`) is the CPU's counterpart of a stream operation:
  its effects are visible to the submitting thread once the task is observed done.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import dataclasses
import math
import numbers
import os
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

import numpy as np

from .._checks import MAX_WORKERS, as_dtype, check_count, check_native_byte_order, described
from .._errors import CaptureError
from .._shared_threads import SharedThreads
from . import native_copy

if TYPE_CHECKING:
    from .hardware import HardwareProfile

ByteRange = tuple[int, int]

# The longest a simulated operation may be said to last (``sim_seconds``, host charges), in
# seconds. Virtual time is a float: past about 1e9 seconds its steps grow coarser than the
# nanoseconds copies are timed in, and a wait is simulated a bounded virtual stretch at a time,
# so a kernel said to last 1e30 seconds would be simulated for ever. Eleven and a half days is
# more than any chunk's kernel.
MAX_SIM_SECONDS = 1e6

# what both backends say when a compute allocated device memory while a graph was being captured
CAPTURED_ALLOCATION_ADVICE = (
    "a graph would keep writing memory the framework hands out again after the capture; write into existing "
    "arrays (y, a view of it, or scratch arrays made outside the callable): with out= (np.multiply(x, 2, out=y) "
    "rather than y[...] = x * 2) or in place (y *= 2)")

# The dtypes an array on a device may have, on every backend: bool, and integers, floats and
# complex numbers of the sizes that CuPy, PyTorch and CUDA C all have types for. Nothing else is
# held on a GPU by every array type ringflow hands a compute: PyTorch has no tensor of dates,
# strings, records or raw bytes, CuPy computes on none of them, and neither has a long double. The
# simulated GPU (numpy) would hold any of them, so both backends refuse the rest, in the same words
# (:func:`check_device_dtype`), and a program that runs on the simulated GPU runs on a real one.
DEVICE_DTYPES = frozenset(np.dtype(c) for c in "?bBhHiIqQefdFD")
DEVICE_DTYPE_NAMES = "bool, int8 to int64, uint8 to uint64, float16, float32, float64, complex64 or complex128"


def _device_dtype_advice(dtype: np.dtype) -> str:
    """What to do with an array ``a`` of ``dtype``, a dtype no device array may have."""
    kind, size = dtype.kind, dtype.itemsize
    if kind in "mM":
        return "view it as int64 for the device (a.view(np.int64)) and the result back on the host (y.view(a.dtype))"
    if kind == "U":
        return "pass the characters' code points: a.view(np.uint32) (the last axis grows by the string length)"
    if kind == "S":
        return "pass its bytes: a.view(np.uint8) (the last axis grows by the string length)"
    if dtype.fields:
        return ("pass each field as an array of its own: {name: a[name] for name in a.dtype.names} is an item of "
                "several arrays, and output= takes a dict of (shape, dtype) pairs")
    if kind in "fc":
        return f"convert it first: a.astype(np.{'float64' if kind == 'f' else 'complex128'})"
    if size in (1, 2, 4, 8):
        return f"view its bytes as numbers of its size: a.view(np.uint{8 * size})"
    return "view its bytes as numbers: a.view(np.uint8) (the last axis grows by the item size)"


def check_device_dtype(name: str, dtype: np.dtype) -> None:
    """Refuse a dtype that no array on a device may have: one outside :data:`DEVICE_DTYPES`
    (dates, strings, records, raw bytes, long doubles, Python objects), one in non-native byte
    order, or one whose items have 0 bytes. Both backends check it wherever an array on the
    device is made (:meth:`Buffer.array`), and the pipeline checks it for every array it will
    move there (items, ``prepare``'s arrays, ``x``, ``output``) before any device work.

    Raises:
        TypeError: not one of :data:`DEVICE_DTYPES`, Python objects or non-native byte order,
            naming ``name``, the dtypes a device takes, and what to pass instead.
        ValueError: items of 0 bytes, naming ``name`` and what to use instead.
    """
    if dtype in DEVICE_DTYPES:
        return
    if dtype.hasobject:  # a pointer to a Python object means nothing on the device
        raise TypeError(f"{name}: dtype {dtype} holds Python objects, which ringflow cannot move (it moves arrays "
                        f"as raw bytes); use a numeric dtype: {DEVICE_DTYPE_NAMES}")
    check_native_byte_order(name, dtype)
    # arrays travel as raw bytes and are rebuilt from them by shape and dtype: with 0 bytes an
    # item there is nothing to rebuild from (numpy cannot view 0 bytes as such an array)
    if dtype.itemsize == 0:
        raise ValueError(f"{name}: dtype {dtype} has items of 0 bytes, which ringflow cannot move (it moves arrays as "
                         f"raw bytes); use a dtype of at least 1 byte per item, such as 'u1'")
    home = getattr(dtype.type, "__module__", "numpy").partition(".")[0]
    if home != "numpy":
        # a type another package adds to numpy (ml_dtypes' bfloat16, float8s, int4): several
        # have a GPU type of their own (PyTorch's torch.bfloat16, CUDA's __nv_bfloat16), but not
        # in every array type ringflow hands a compute; their bits travel as they are
        bits = 8 * dtype.itemsize if dtype.itemsize in (1, 2, 4, 8) else 8
        raise TypeError(f"{name}: dtype {dtype} (from {home}) is not one ringflow moves as itself (a device array's "
                        f"dtype is {DEVICE_DTYPE_NAMES}); move its bits: pass a.view(np.uint{bits}) and view them "
                        f"back where they are read (in the compute, x.view(torch.{dtype}) where PyTorch has the "
                        f"type; on the host, y.view(a.dtype))")
    raise TypeError(f"{name}: dtype {dtype} cannot be an array on a GPU (CuPy, PyTorch and CUDA kernels have no "
                    f"such type, so the simulated GPU refuses it too); a device array's dtype is "
                    f"{DEVICE_DTYPE_NAMES}: {_device_dtype_advice(dtype)}")


def check_seconds(seconds: Any, what: str) -> float:
    """``seconds``, a duration given by the caller, as a float: a real number from 0 to
    :data:`MAX_SIM_SECONDS`. ``what`` names the argument in the message.

    Raises:
        TypeError: not a real number (a string, None, a bool).
        ValueError: negative, NaN, or more than :data:`MAX_SIM_SECONDS`.
    """
    if isinstance(seconds, (bool, np.bool_)) or not isinstance(seconds, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, got {type(seconds).__name__} {seconds!r}")
    if not (0 <= seconds <= MAX_SIM_SECONDS):
        raise ValueError(f"{what} must be a number of seconds from 0 to {MAX_SIM_SECONDS:g}, got {seconds!r}")
    return float(seconds)


def check_priority(priority: Any, capabilities: "Capabilities") -> int:
    """``priority``, a stream priority, as an int within ``capabilities.stream_priorities``.

    Raises:
        TypeError: not an integer.
        ValueError: outside the device's range (the message gives it).
    """
    if isinstance(priority, (bool, np.bool_)) or not isinstance(priority, numbers.Integral):
        raise TypeError(f"stream priority must be an int, got {type(priority).__name__} {priority!r}")
    least, greatest = capabilities.stream_priorities
    if not greatest <= priority <= least:
        raise ValueError(f"stream priority {priority} is outside the device's range "
                         f"[{greatest} (highest), {least} (lowest)]")
    return int(priority)


def check_workers(workers: Any) -> int:
    """``workers``, the size of a device's worker pool, as an int from 1 to
    :data:`~ringflow._checks.MAX_WORKERS` (as many as a pipeline's ``workers=`` may ask for).

    Raises:
        TypeError: not an integer.
        ValueError: out of range.
    """
    return check_count("create_worker_pool(workers)", workers, maximum=MAX_WORKERS)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What the device can overlap, read from its attributes (or from the sim profile)."""

    name: str
    backend: str  # "cuda" or "sim"
    compute_capability: tuple[int, int]
    sm_count: int
    async_engine_count: int  # copy engines: 2+ lets H2D and D2H run at once beside compute
    concurrent_kernels: bool
    memory_pools: bool  # stream-ordered allocation (cudaMallocAsync) is supported
    stream_priorities: tuple[int, int]  # (least, greatest); CUDA's greatest is numerically lowest
    host_register: bool  # an existing host allocation can be pinned in place
    unified_addressing: bool
    total_memory: int  # bytes of device memory

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class LiveCounts:
    """Objects a device has handed out and not yet released; all zero after a clean close.

    ``pooled_host_buffers`` are the device's host pool's blocks (cached, or behind arrays still
    alive): the pool's to keep until ``release_cached``, so they are not in ``host_buffers`` or
    ``total``."""

    host_buffers: int
    device_buffers: int
    streams: int
    events: int
    pooled_host_buffers: int = 0

    @property
    def total(self) -> int:
        return self.host_buffers + self.device_buffers + self.streams + self.events


# Copies of at least this many bytes per thread are split over Python threads. Below it, handing
# parts of a copy to them costs more than it saves: each hand-off and wait takes the GIL from
# threads that need it (a submitting thread's own Python, the progress thread), and a
# request-sized item was staged faster on the calling thread alone (docs/design.md, "Pinned
# staging and results"). Native copy threads (:mod:`.native_copy`) never take the GIL, so they
# split from NATIVE_SPLIT_BYTES a thread, over at most half the host's CPUs.
SPLIT_COPY_BYTES = 4 << 20
MAX_COPY_THREADS = 4
NATIVE_SPLIT_BYTES = 128 << 10
NATIVE_MAX_THREADS = max(1, min(16, (os.cpu_count() or 1) // 2))
_COPY_THREADS = SharedThreads(MAX_COPY_THREADS - 1, "ringflow-copy")  # the caller copies a part too


def copy_threads(nbytes: int) -> int:
    """Threads :meth:`Device.host_copy` uses for a copy of ``nbytes``: up to
    :data:`NATIVE_MAX_THREADS` where native copies are available, else
    :func:`python_copy_threads`."""
    if native_copy.copier() is not None:
        return max(1, min(NATIVE_MAX_THREADS, nbytes // NATIVE_SPLIT_BYTES))
    return python_copy_threads(nbytes)


def python_copy_threads(nbytes: int) -> int:
    """Python threads a copy of ``nbytes`` is split over (1 up to :data:`MAX_COPY_THREADS`);
    also the split the simulated GPU charges a copy's time at, whatever the machine it runs on
    has (its CPUs, a C compiler), so that a simulated timeline does not depend on that."""
    return max(1, min(MAX_COPY_THREADS, nbytes // SPLIT_COPY_BYTES))


def parallel_copy(dst: np.ndarray, src: np.ndarray, threads: int) -> None:
    """``np.copyto(dst, src)`` split along the flat C-order bytes over ``threads`` threads (the
    calling one among them): native threads where available, else Python threads; C-contiguous
    arrays of one shape and dtype only (else one thread)."""
    if threads <= 1 or dst.nbytes < threads or not dst.flags.c_contiguous or not src.flags.c_contiguous or dst.dtype != src.dtype \
            or dst.shape != src.shape:
        np.copyto(dst, src, casting="no")
        return
    if native_copy.copy(dst, src, threads):
        return
    pool = _COPY_THREADS.get()
    d, s = dst.reshape(-1).view(np.uint8), np.ascontiguousarray(src).reshape(-1).view(np.uint8)
    step = -(-d.nbytes // threads)
    job = _SplitCopy([(d[a:a + step], s[a:a + step]) for a in range(0, d.nbytes, step)])
    try:
        for _ in range(len(job.parts) - 1):
            pool.submit(job.run_pooled)
        job.run_here()
    finally:
        # also where a Ctrl-C stopped the caller: a part still queued or copying would write dst
        # after this call had raised. The loop is here, not in a function called: an interrupt
        # at that function's start would skip it
        caught = None
        while True:
            try:
                job.settle()
                break
            except BaseException as exc:  # noqa: BLE001 - raised once the parts are done
                caught = caught or exc
        if caught is not None:  # a Ctrl-C while settling is raised, never lost
            try:
                raise caught
            finally:
                del caught  # this frame is in its traceback
    error, job.error = job.error, None  # (its traceback holds the job)
    if error is not None:
        raise error


class _SplitCopy:
    """The parts of one split copy, each claimed once, by a pool thread (:meth:`run_pooled`) or
    the caller (:meth:`run_here`). A pool thread claims a part and counts it running in one step
    under the lock, so the caller always knows which parts a pool thread may still be writing,
    and a part nobody has claimed can be withdrawn (:meth:`settle`)."""

    __slots__ = ("parts", "claimed", "running", "error", "lock", "gate")

    def __init__(self, parts: list) -> None:
        self.parts = parts
        self.claimed = 0  # parts handed out so far, to anyone
        self.running = 0  # parts pool threads are copying now
        self.error: Optional[BaseException] = None  # the first a pool thread's part raised
        self.lock = threading.Lock()
        # released as the last running pool part ends; a plain lock (its acquire and release are
        # single C calls), so that a Ctrl-C in the caller's wait leaves nothing half done
        self.gate = threading.Lock()
        self.gate.acquire()

    def run_pooled(self) -> None:
        """On a pool thread: copy parts until none is left to claim."""
        while True:
            part = self._claim(running=True)
            if part is None:
                return
            try:
                np.copyto(*part)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                with self.lock:
                    if self.error is None:
                        self.error = exc
            finally:
                with self.lock:
                    self.running -= 1
                    last = not self.running
                if last:
                    try:
                        self.gate.release()
                    except RuntimeError:  # released already: the caller has a wake pending
                        pass

    def run_here(self) -> None:
        """On the caller's thread: copy parts until none is left to claim."""
        while True:
            part = self._claim(running=False)
            if part is None:
                return
            np.copyto(*part)

    def _claim(self, running: bool) -> Optional[tuple]:
        """The next unclaimed part, claimed (and, for a pool thread, counted ``running`` in the
        same step under the lock, so :meth:`settle` never misses a part being written), or None
        when every part is claimed or withdrawn."""
        with self.lock:
            if self.claimed >= len(self.parts):
                return None
            part = self.parts[self.claimed]
            self.claimed += 1
            if running:
                self.running += 1
            return part

    def settle(self) -> None:
        """Withdraw the parts nobody has claimed and wait for those pool threads are copying."""
        while True:
            with self.lock:
                self.claimed = len(self.parts)
                if not self.running:
                    return
            self.gate.acquire()


def close_quietly(obj: Any, what: str) -> None:
    """Close ``obj``; a failure becomes a warning so it never masks the caller's exception."""
    try:
        obj.close()
    except Exception as exc:  # noqa: BLE001 - cleanup must not raise
        warnings.warn(f"closing {what} failed: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)


def free_quietly(buffer: "DeviceBuffer", stream: "Stream | None", what: str) -> None:
    """Free device memory in ``stream``'s order (at once, with None), as close_quietly does."""
    close_quietly(_FreeOn(buffer, stream) if stream is not None else buffer, what)


class _ClosedOnExit(abc.ABC):
    """A resource that a ``with`` block closes as it leaves: through :func:`close_quietly`, so
    that a close that fails warns instead of masking the block's own exception."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        close_quietly(self, repr(self))


class _FreeOn:
    """``buffer``'s stream-ordered free as a ``close()``. (A class made in each call would keep
    the buffer alive in its closure until the cyclic collector frees the class.)"""

    def __init__(self, buffer: "DeviceBuffer", stream: "Stream"):
        self.buffer, self.stream = buffer, stream

    def close(self) -> None:
        self.buffer.close(stream=self.stream)


def stream_after(streams: Sequence["Stream"]) -> "Stream | None":
    """The first of ``streams``, made to wait for everything enqueued so far on the others: a
    stream-ordered free there comes after all of their work. None when there are no streams
    or ordering failed (a broken device): free after a device-wide wait instead."""
    if not streams:
        return None
    first, *others = streams
    try:
        for s in others:
            first.wait(s.record())
    except Exception:  # noqa: BLE001 - a broken device: the caller falls back to a plain free
        return None
    return first


def check_nbytes(nbytes: int, what: str) -> int:
    """``nbytes`` as a positive int.

    Raises:
        TypeError: not an int (a bool, a float even of whole bytes, a string), naming ``what``
            and showing the value.
        ValueError: 0 or less.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"{what} must be an int number of bytes, got {described(nbytes)}; give a whole number of "
                        "bytes as an int, such as 1 << 30")
    nbytes = int(nbytes)
    if nbytes <= 0:
        raise ValueError(f"{what} must be a positive number of bytes, got {nbytes}; ask for at least 1 byte")
    return nbytes


class Buffer(_ClosedOnExit):
    """A contiguous allocation. Closing twice is harmless; using a closed buffer raises."""

    nbytes: int
    is_host: bool

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def owner(self) -> "Device | None":
        """The device that allocated or registered this buffer, the only one whose streams may
        use it; None where the backend does not say."""
        return None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed; allocate a new buffer instead of reusing a closed one")

    def slice(self, offset: int, nbytes: int | None = None) -> "BufferSlice":
        """A byte range of this buffer, for copies and launches that touch only part of it."""
        self._check_open()
        if nbytes is None:
            nbytes = self.nbytes - offset
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(
                f"slice [{offset}, {offset + nbytes}) is outside {self!r} of {self.nbytes} bytes; "
                "keep offset + nbytes within the buffer"
            )
        return BufferSlice(self, offset, nbytes)

    def array(self, dtype: Any, shape: Sequence[int] | int, offset: int = 0) -> "ArrayArg":
        """A typed view of this buffer's bytes to pass to :meth:`Stream.launch`.

        Args:
            dtype: the elements' numpy dtype.
            shape: the array's shape (an int for one dimension).
            offset: the byte at which the array starts; a multiple of
                :func:`device_alignment` of ``dtype``.

        Raises:
            TypeError: ``dtype`` is not one a device array may have (:func:`check_device_dtype`).
            ValueError: the array does not fit in the buffer from ``offset``, or ``offset`` is
                not a multiple of the dtype's alignment on a GPU.
        """
        dtype = as_dtype(dtype)
        check_device_dtype("array(dtype)", dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        where = self.slice(offset, nbytes)
        # a buffer starts on a 256-byte boundary on a GPU, so the offset decides the alignment.
        # numpy reads a misaligned array (the simulated GPU would compute right), but a GPU kernel
        # loading it stops with a misaligned-address error, which breaks the whole device
        align = device_alignment(dtype)
        if offset % align:
            below = offset - offset % align
            raise ValueError(f"an array of {dtype} at byte offset {offset} of {self!r} is misaligned: a GPU reads "
                             f"{dtype} only from a multiple of {align} bytes (a kernel would stop with a "
                             f"misaligned-address error that breaks the device); start it at offset {below} or "
                             f"{below + align}")
        return ArrayArg(where, dtype, shape)


def device_alignment(dtype: np.dtype) -> int:
    """The byte boundary an array of ``dtype`` (one of :data:`DEVICE_DTYPES`) must start on for
    GPU code to read it: a number's own size (a CUDA load of an N-byte number needs an address
    that is a multiple of N, and CuPy's and PyTorch's complex types are aligned to their whole
    size)."""
    return dtype.itemsize


@dataclasses.dataclass(frozen=True)
class BufferSlice:
    """Bytes ``[offset, offset + nbytes)`` of ``buffer``."""

    buffer: Buffer
    offset: int
    nbytes: int

    @property
    def range(self) -> ByteRange:
        return (self.offset, self.offset + self.nbytes)

    def array(self, dtype: Any, shape: Sequence[int] | int) -> "ArrayArg":
        return self.buffer.array(dtype, shape, self.offset)


@dataclasses.dataclass(frozen=True)
class ArrayArg:
    """A typed view (dtype, shape) of a buffer range; launch hands ``fn`` the backend's array."""

    where: BufferSlice
    dtype: np.dtype
    shape: tuple[int, ...]

    # numpy would make a 0-d object array holding this description (and compare that, silently
    # unequal: np.array_equal gives False for an array it cannot read); a GPU framework's array
    # refuses to become a host array too
    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise TypeError(self._not_on_the_host())

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        raise TypeError(self._not_on_the_host())

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        raise TypeError(self._not_on_the_host())

    def _not_on_the_host(self) -> str:
        return (f"this is an array of the simulated GPU's device memory ({self.shape} {self.dtype}, a launch "
                f"argument), not a host array: numpy cannot read it on the host. Read it in a launch on a stream, as "
                f"a GPU's work would: stream.launch(fn, arg, reads=[arg]) calls fn with its data once the stream has "
                f"run up to there (fn may copy it into a host array), then stream.sync(); on a GPU the framework's "
                f"array is read with .get() (CuPy) or .cpu() (PyTorch)")


def as_slice(obj: "Buffer | BufferSlice | ArrayArg") -> BufferSlice:
    if isinstance(obj, BufferSlice):
        obj.buffer._check_open()
        return obj
    if isinstance(obj, ArrayArg):
        obj.where.buffer._check_open()
        return obj.where
    if isinstance(obj, Buffer):
        obj._check_open()
        return BufferSlice(obj, 0, obj.nbytes)
    raise TypeError(f"expected a Buffer, BufferSlice or ArrayArg, got {type(obj).__name__}")


def copy_extent(dst: "Buffer | BufferSlice", src: "Buffer | BufferSlice", nbytes: int | None) -> tuple[BufferSlice, BufferSlice]:
    """Resolve the ranges a copy touches, refusing a copy larger than either side."""
    d, s = as_slice(dst), as_slice(src)
    n = min(d.nbytes, s.nbytes) if nbytes is None else int(nbytes)
    if n <= 0:
        raise ValueError(f"copy of {n} bytes: copy at least 1 byte")
    if n > s.nbytes or n > d.nbytes:
        raise ValueError(
            f"copy of {n} bytes does not fit: source holds {s.nbytes} bytes and destination {d.nbytes}; "
            "copy at most the smaller of the two"
        )
    return BufferSlice(d.buffer, d.offset, n), BufferSlice(s.buffer, s.offset, n)


class HostBuffer(Buffer):
    """Host memory the copy engines can read and write directly (pinned or registered)."""

    is_host = True
    registered: bool = False  # True when an existing array was pinned in place

    def holds(self, array: np.ndarray) -> bool:
        """Whether ``array``'s bytes are this buffer's, from its first byte (C-contiguous and no
        longer than the buffer). No device work is checked or ordered by this query."""
        return self.offset_of(array) == 0

    def offset_of(self, array: np.ndarray) -> Optional[int]:
        """The byte offset in this buffer at which ``array``'s bytes start, where they are all
        this buffer's and C-contiguous; else None. No device work is checked or ordered by this
        query."""
        self._check_open()
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            return None
        base = getattr(self, "_base_address", None)
        if base is None:  # the buffer's memory never moves: its address is asked once
            base = self._base_address = self._memory().__array_interface__["data"][0]
        offset = array.__array_interface__["data"][0] - base
        return offset if 0 <= offset and offset + array.nbytes <= self.nbytes else None

    @abc.abstractmethod
    def _memory(self) -> np.ndarray:
        """The 1-D uint8 array over the buffer's bytes, for queries that touch no byte."""

    @abc.abstractmethod
    def view(self, dtype: Any = np.uint8, *, offset: int = 0, count: int | None = None,
             access: str = "rw") -> np.ndarray:
        """A numpy view of ``count`` items (default: all that fit) from byte ``offset``.

        ``access`` is ``"r"``, ``"w"`` or ``"rw"``; an ``"r"`` view is read-only. On the
        simulated GPU each call is a checked host access at that moment: take a fresh view for
        each access instead of keeping one across device operations."""


class DeviceBuffer(Buffer):
    """Device memory from the stream-ordered pool."""

    is_host = False

    @abc.abstractmethod
    def close(self, stream: "Stream | None" = None) -> None:
        """Free the memory. With ``stream`` the free is stream-ordered: it happens after the work
        already enqueued there, and the caller must have ordered other streams' use before it."""


class Event(abc.ABC):
    """Marks a point in a stream: done once every operation enqueued before it has completed."""

    timing: bool

    @property
    @abc.abstractmethod
    def is_done(self) -> bool:
        """Non-blocking query. True also tells the querying thread that the work before the
        event is complete (the same ordering a sync gives)."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Block the calling thread until the event is done; raises the error of a failed
        launch before it (:class:`~ringflow._errors.LaunchError`) or a sticky device error."""

    @property
    def error(self) -> BaseException | None:
        """The error a failed operation before this event reported, once done; else None."""
        return None

    @property
    def owner(self) -> "Device | None":
        """The device whose stream recorded the event; None where the backend does not say."""
        return None

    @abc.abstractmethod
    def elapsed_since(self, earlier: "Event") -> float:
        """Seconds between two timing events (both recorded with ``timing=True``, both done)."""


class Stream(_ClosedOnExit):
    """An in-order queue of device work; never synchronises with the legacy default stream."""

    priority: int

    @property
    @abc.abstractmethod
    def owner(self) -> "Device":
        """The device whose work this stream queues."""

    @abc.abstractmethod
    def record(self, *, timing: bool = False) -> Event:
        """Enqueue an event; it completes after everything enqueued on this stream before it.
        Events for ordering are made without timing; ``timing=True`` only when profiling."""

    @abc.abstractmethod
    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``; the host does not block. On a
        device whose worker pools model host work (``WorkerPool.models_host_work``) ``event`` may
        also be what :meth:`WorkerPool.host_work` returned: later work waits for that host work.

        Raises:
            TypeError: ``event`` is not an event of this backend.
            ValueError: ``event`` was recorded on another device (:func:`check_event_device`).
        """

    @abc.abstractmethod
    def copy(self, dst: Buffer | BufferSlice, src: Buffer | BufferSlice, nbytes: int | None = None) -> None:
        """Enqueue an asynchronous copy in any direction; returns once enqueued. ``dst`` holds
        the data after an event recorded later on this stream completes. ``src`` must not be
        written, and ``dst`` not touched, until then."""

    @abc.abstractmethod
    def fill(self, dst: Buffer | BufferSlice, byte: int) -> None:
        """Enqueue a memset of ``dst`` to ``byte`` (used to poison released slots)."""

    @abc.abstractmethod
    def launch(self, fn: Callable[..., Any], *args: Any, reads: Iterable[Any] = (), writes: Iterable[Any] = (),
               sim_seconds: float | None = None) -> None:
        """Run a compute callable on this stream; returns once enqueued.

        ``args`` are passed to ``fn``; each :class:`ArrayArg` becomes the backend's array (numpy
        on ``sim``, CuPy or PyTorch on ``cuda``). ``reads``/``writes`` name the buffers (or
        slices, or array args) ``fn`` reads and writes; array args named in neither are taken
        as read and written. While ``fn`` runs, the array framework's current stream is this
        stream. ``sim_seconds`` is the kernel's duration on the simulated GPU, 0 to
        :data:`MAX_SIM_SECONDS` (ignored on a real one; by default the sim models a
        memory-bound kernel over the bytes touched).
        """

    @abc.abstractmethod
    def sync(self) -> None:
        """Block until all work enqueued on this stream is done. Raises a sticky device error,
        and the first error of a failed launch on this stream since its last sync (where
        :attr:`Device.launch_errors_on_events`), even if an event recorded after the launch has
        reported it already."""

    def begin_capture(self) -> None:
        """Start capturing: from now on, work enqueued on this stream, and on every stream that
        waits for an event recorded during the capture, is recorded into a graph instead of
        run, until :meth:`end_capture`. A :meth:`launch`'s callable is called once, while
        capturing, and never by the graph's launches, which replay the device work it did
        then: what it read on the host (a global, a counter) stays as it was at the capture
        (the simulated GPU records its numpy work on stand-in arrays for that, and refuses
        what would read the device's data on the host). Events recorded while capturing can
        only be waited on by capturing streams: querying or syncing one, waiting on an event
        recorded before the capture, synchronising a capturing stream or allocating device
        memory on the capturing thread abandons the capture
        (:class:`~ringflow._errors.CaptureError`).

        Raises:
            CaptureError: the backend cannot capture, or this stream is capturing already.
        """
        raise CaptureError(f"{type(self).__name__} cannot capture graphs")

    def end_capture(self) -> "Graph":
        """End the capture begun on this stream and return its graph. Every stream that joined
        must have been joined back: this stream waited for an event recorded on it after the
        last work it captured.

        Raises:
            CaptureError: the capture was abandoned, or a stream was left unjoined; the capture
                has ended either way and nothing captured has run.
        """
        raise CaptureError(f"{type(self).__name__} cannot capture graphs")

    def abort_capture(self) -> None:  # noqa: B027 - a no-op where nothing can capture, not abstract
        """End a capture begun on this stream without keeping it (after an error); harmless
        when none is in progress; never raises."""


class Graph(abc.ABC):
    """Stream work captured once (:meth:`Stream.begin_capture`) and launched as one unit, any
    number of times, with the dependencies it was captured with. It refers to the memory the
    captured work used without owning it: the caller keeps that memory alive and in place for
    as long as the graph may run."""

    @abc.abstractmethod
    def launch(self, stream: Stream) -> None:
        """Enqueue one run of the whole graph on ``stream`` (a stream of the graph's device):
        it starts after the work enqueued there before, and work enqueued there later starts
        after all of it. Returns once enqueued.

        Raises:
            RuntimeError: the graph is closed.
        """

    def event(self, captured: Event) -> "Event | None":
        """The event the last launch recorded in place of ``captured`` (an event recorded
        during the capture): its :attr:`~Event.error` tells whether the work before it failed.
        None where the backend's graphs keep no events (a real GPU)."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Release the graph; runs already launched complete. Harmless twice; never raises."""


class HostTask(abc.ABC):
    """A CPU job submitted to a :class:`WorkerPool`; waitable like an :class:`Event`."""

    @property
    @abc.abstractmethod
    def is_done(self) -> bool: ...

    @abc.abstractmethod
    def sync(self) -> None:
        """Block until the task has run (its exception is not raised here; see ``result``)."""

    @abc.abstractmethod
    def result(self) -> Any:
        """The callable's return value; raises its exception. Only after the task is done."""

    @property
    def span(self) -> "tuple[float, float | None] | None":
        """(start, end) of the callable's run on the device's host clock, once it has started
        (end None while running); None if the backend does not know."""
        return None


class WorkerPool(_ClosedOnExit):
    """CPU workers for the host stages (staging copies release the GIL, so threads scale)."""

    workers: int
    # whether host_work stands for time the pool spends (the simulated GPU's): a real host spends its
    # own, and a caller then asks for none (nothing per chunk on a real GPU's scheduler)
    models_host_work: bool = False

    @abc.abstractmethod
    def submit(self, fn: Callable[..., Any], *args: Any, nbytes: int = 0, sim_seconds: float | None = None,
               after: Any = None) -> HostTask:
        """Run ``fn(*args)`` on a worker. ``nbytes`` (bytes the job copies) and ``sim_seconds``
        set its duration on the simulated GPU's virtual clock, and ``after`` (what
        :meth:`host_work` returned, or None) host work it starts after; a real pool ignores all
        three."""

    def host_work(self, seconds: float) -> Any:
        """Host work of ``seconds`` that a model says the pool's submitter does (the scheduler's
        time per chunk, ``ringflow._plan.host_seconds_per_chunk``), for :meth:`submit`'s ``after``
        or a stream's :meth:`Stream.wait`. A real pool returns None: its host spends its own
        time. The simulated pool runs it on a lane of the submitter's own, one piece after
        another, beside everything else (the submitter is not held meanwhile), and returns a
        token whose ``span`` is the ``(start, end)`` of that virtual time once it is done.

        Raises:
            TypeError: ``seconds`` is not a real number.
            ValueError: ``seconds`` is negative, NaN or more than :data:`MAX_SIM_SECONDS`.
        """
        check_seconds(seconds, "host_work(seconds)")
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Wait for submitted tasks and stop the workers."""


Waitable = "Event | HostTask"


class Device(_ClosedOnExit):
    """One GPU (or the simulated one). Made by :func:`ringflow.device`."""

    backend: str  # "cuda" or "sim"
    name: str
    # Whether an event recorded after a launch can report an error of that launch's compute
    # alone: the simulated GPU runs a compute at its turn on the device timeline, so its errors
    # arrive on the stream's events. A real GPU runs the callable (which enqueues kernels) inside
    # ``launch``, which raises what it raises; a kernel's own fault is sticky and breaks the
    # whole context. So an event per launch is worth recording only where this is True.
    launch_errors_on_events: bool = False

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What the device can do: its name, backend, compute capability, SM count, copy
        engines, whether kernels run concurrently, stream-ordered memory pools, stream
        priorities, host registration, unified addressing and total memory (bytes)."""

    @property
    def hardware(self) -> "HardwareProfile":
        """The hardware model (link and copy rates by size, host copy and registration rates,
        launch costs) that the planner sizes chunks and rings with for this device. A real GPU
        uses the profile ``ringflow doctor --save`` cached for its model and driver, else the
        H200 profile with a note on the ``"ringflow"`` logger (see
        :func:`ringflow._device.hardware.profile_for_gpu`; ``RINGFLOW_CALIBRATE=1`` measures
        it on first use instead)."""
        cached = getattr(self, "_hardware", None)  # looked up once per device object: the planner asks on every call
        if cached is None:
            from .hardware import profile_for_gpu  # (imported here once: an import statement costs every call)

            cached = self._hardware = profile_for_gpu(self.name, device=self)
        return cached

    @property
    @abc.abstractmethod
    def now(self) -> float:
        """The host clock in seconds (virtual time on the sim)."""

    @abc.abstractmethod
    def create_stream(self, priority: int = 0) -> Stream:
        """A new non-blocking stream; lower numbers are higher priority, as in CUDA."""

    @abc.abstractmethod
    def allocate_host(self, nbytes: int) -> HostBuffer:
        """Pinned (page-locked) host memory.

        Raises:
            MemoryError: there is no memory for it (on a GPU an
                :class:`~ringflow._errors.OutOfMemoryError`, a DeviceError that is not sticky).
        """

    @abc.abstractmethod
    def register_host(self, array: np.ndarray) -> HostBuffer:
        """Pin an existing C-contiguous numpy array in place (cudaHostRegister); the array must
        outlive the buffer, and closing the buffer unregisters it."""

    @abc.abstractmethod
    def allocate(self, nbytes: int, stream: Stream | None = None) -> DeviceBuffer:
        """Device memory from the stream-ordered pool; usable on ``stream`` at once and on
        other streams once they are ordered after it.

        Raises:
            OutOfMemoryError: (a ``MemoryError`` and a DeviceError that is not sticky: the
                device stays usable) the device has no memory for it.
        """

    @abc.abstractmethod
    def create_worker_pool(self, workers: int) -> WorkerPool:
        """A pool of ``workers`` host threads for CPU stages (on the simulated GPU, lanes on its
        virtual clock).

        Raises:
            TypeError: ``workers`` is not an integer.
            ValueError: ``workers`` is not from 1 to :data:`~ringflow._checks.MAX_WORKERS`.
        """

    @abc.abstractmethod
    def wait_any(self, waitables: Sequence[Any], timeout: float | None = None,
                 wake: "threading.Event | None" = None) -> list[Any]:
        """Block until at least one of the events / host tasks is done, ``timeout`` seconds pass,
        or ``wake`` is set (by another thread: new work to start); returns those done. Observing
        one done orders the caller after it. ``timeout``: None or infinity waits without limit,
        a negative number does not wait.

        Raises:
            TypeError: ``timeout`` is not a number or None.
            ValueError: ``timeout`` is NaN.
        """

    def publish(self) -> Any:
        """A token of everything the calling host thread has done and seen, for another thread
        to :meth:`observe` when it takes over work from this one (a queue put, a future set).
        Real GPUs need no token (the hand-off's own lock orders the threads); the simulated one's
        happens-before checker does."""
        return None

    def observe(self, token: Any) -> None:  # noqa: B027 - a no-op by default, not abstract
        """Order the calling host thread after the hand-off that made ``token`` (:meth:`publish`)."""
        return None

    def fold_tokens(self, tokens: list) -> list:
        """``tokens`` (from :meth:`publish`) less those that another of them orders at least as
        much as, in their order: observing the rest orders a thread exactly as observing all of
        them would. A holder of tokens that keep coming (a pooled array used again and again)
        keeps them bounded this way. Real GPUs' tokens are None and are all dropped."""
        return [t for t in tokens if t is not None]

    def sharing_host(self, threads: int) -> "contextlib.AbstractContextManager[None]":
        """Declare, until the returned context ends, that this device's work copies host memory
        with ``threads`` threads alongside the other devices of its host (a job run over several
        devices declares each of them for the call). The simulated GPUs of one host
        (``"sim:N"``) then share its host copy rate (:class:`~ringflow._device.sim.host.SimHost`);
        a real GPU's host shares itself, so here it does nothing."""
        return contextlib.nullcontext()

    def timing_floor(self, stream: "Stream") -> float:
        """Seconds two timing events recorded back to back on ``stream`` are apart with nothing
        between them: what the events themselves add to every span they bracket. 0.0 here (the
        simulated GPU's events take no time); a real GPU measures it on ``stream`` once."""
        return 0.0

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass on the host clock without doing host work (the sim advances its
        virtual clock, running the device meanwhile).

        Raises:
            TypeError: ``seconds`` is not a real number.
            ValueError: ``seconds`` is negative, NaN or more than :data:`MAX_SIM_SECONDS`.
        """
        import time

        time.sleep(check_seconds(seconds, "sleep(seconds)"))

    def record_on(self, stream: Any) -> "Event | None":
        """An event on ``stream`` (one of this device's streams; a real GPU also takes foreign
        streams, see its backend), after which work already enqueued there is done; None for
        ``stream=None`` here: nothing to order after (a real GPU records on its default stream).

        Raises:
            TypeError: ``stream`` is not a stream this device can record on.
        """
        if stream is None:
            return None
        if isinstance(stream, Stream):
            return check_own_stream(self, stream).record()
        raise TypeError(f"stream must be a stream of {self!r} (device.create_stream()) or None, "
                        f"got {type(stream).__name__}")

    def check_dtype(self, name: str, dtype: np.dtype) -> None:
        """Refuse ``dtype`` for an array on this device, naming ``name``: the rule every backend
        keeps (:func:`check_device_dtype`), narrowed where this device's array type holds fewer
        (a real GPU handing computes tensors of a PyTorch without unsigned 16-, 32- and 64-bit
        ones). :meth:`Buffer.array` checks the same.

        Raises:
            TypeError, ValueError: as :func:`check_device_dtype`; TypeError for a dtype the
                array type lacks, naming it and what to do instead.
        """
        check_device_dtype(name, dtype)

    def device_source(self, obj: Any) -> "tuple | None":
        """Where ``obj``, an array in this device's memory, lies for a copy engine to read in
        place: ``(BufferSlice, shape, numpy dtype, producer stream or None)``; None when ``obj``
        is no such array (each backend says which arrays it knows)."""
        return None

    def device_array(self, arg: "ArrayArg") -> Any:
        """``arg`` as the caller can use it outside a launch: a framework array on a real GPU;
        on the simulated GPU the argument itself (its memory is reached through launches)."""
        return arg

    def host_copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy ``src`` into ``dst`` (same shape and dtype) for the calling thread, which waits
        for it: a large copy is split over :func:`copy_threads` threads (numpy's copies let go of
        the GIL, and one thread copies at a fraction of the host's rate); the simulated GPU
        charges the calling thread the copy's time at that many threads' host copy rate
        (:attr:`hardware`)."""
        parallel_copy(dst, src, copy_threads(dst.nbytes))

    @abc.abstractmethod
    def live(self) -> LiveCounts:
        """Buffers, streams and events handed out and not yet released."""

    def runs_caller(self) -> bool:
        """Whether the calling thread runs inside this device's own work, where a call that waits
        for the device would wait for the work it runs in: the simulated GPU runs a kernel (a
        compute) and a host task as it advances, and no call made there may wait for it. False
        on a real GPU, where a compute runs on a host thread that only enqueues its kernels."""
        return False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (every later call on the device raises)."""
        return bool(getattr(self, "_closed", False))

    @abc.abstractmethod
    def close(self) -> None:
        """Synchronise and release the device's streams, pools and memory; every later call
        raises. Harmless twice. Ends with :meth:`_run_close_callbacks` (every backend's close
        does), once the device counts as closed."""

    def on_close(self, callback: Callable[["Device"], Any]) -> Callable[[], None]:
        """Call ``callback(device)`` once when this device closes, after it counts as closed, on
        the thread that closes it; at once, on this thread, if it is closed already. For layers
        above the device (a cache of objects built on it) to let go of what they keep for it.

        The device holds ``callback`` until it runs or is cancelled: a callback should not hold
        the device itself (it is passed in), or the two keep each other alive until the cyclic
        collector frees them. A callback that raises an Exception gets a RuntimeWarning: closing
        never raises over it, nor masks an error the caller is handling. One that raises a
        KeyboardInterrupt or SystemExit has it raised by ``close()`` once every other callback
        has run.

        Args:
            callback: called with the device; its result is ignored.

        Returns:
            A function that cancels the callback (harmless after it ran, or twice).

        Raises:
            TypeError: ``callback`` is not callable.
        """
        if not callable(callback):
            raise TypeError(f"on_close needs a callable, got {type(callback).__name__}")
        entry = [callback]  # its own list: cancelling removes this registration, not an equal one
        with _close_callbacks_lock:
            pending = None if self.__dict__.get("_close_callbacks_ran") else self.__dict__.setdefault(
                "_close_callbacks", [])
            if pending is not None:
                pending.append(entry)
        if pending is None:
            _run_callback(self, callback)

        def cancel() -> None:
            with _close_callbacks_lock:
                entry[:] = []  # a close that took the list already finds it empty
                pending = self.__dict__.get("_close_callbacks")
                if pending is not None and any(e is entry for e in pending):
                    pending[:] = [e for e in pending if e is not entry]

        return cancel

    def _run_close_callbacks(self) -> None:
        """Run the :meth:`on_close` callbacks, each once, in the order registered; later
        registrations run at once. Called by every backend's :meth:`close` once the device counts
        as closed, from the one place here so that both run them alike, and again by a close
        that finds the device closed: that call runs those a close stopped part way (a Ctrl-C)
        left, or waits until another thread's close has run them (not where that thread is this
        one: a callback that closes the device again). A callback that raises an Exception
        warns; one that raises a BaseException (KeyboardInterrupt, SystemExit) does not stop the
        others.

        Raises:
            BaseException: the first one a callback raised that is not an Exception, once every
                callback has run.
        """
        me = (os.getpid(), threading.get_ident())
        stop = None
        while True:
            taken, started = False, [False]  # (started: set by _run_callback as it calls it)
            try:
                with _close_callbacks_done:
                    d = self.__dict__
                    d["_close_callbacks_ran"] = True
                    pending = d.setdefault("_close_callbacks", [])
                    running = d.setdefault("_close_callbacks_running", {})  # thread -> callbacks it runs
                    if not pending:
                        # (a thread of another process is a parent's, not in this forked child)
                        if not any(r != me and r[0] == me[0] for r in running):
                            break
                        _close_callbacks_done.wait()
                        continue
                    depth = running.get(me, 0) + 1
                    # taken off the list and marked running with no call in between, where a
                    # Ctrl-C would leave a callback neither listed nor run
                    entry = pending[0]
                    del pending[0]
                    running[me] = depth
                    taken = True
                if entry:  # not cancelled
                    _run_callback(self, entry[0], started)
                else:
                    started[0] = True
            except BaseException as exc:  # noqa: BLE001 - raised once the rest have run
                if not (taken and started[0]):
                    # a Ctrl-C outside any callback (while waiting for another thread's close,
                    # or before this one started: it goes back first on the list, below) stops
                    # the close now, leaving the rest to the next close
                    raise
                # a Ctrl-C in one callback must not leave the others (a cache's hold on the
                # device's engines) never run
                if stop is None:
                    stop = exc
            finally:
                if taken:
                    with _close_callbacks_done:
                        # no call until the mark is gone and a callback not started is listed again
                        depth = running[me]
                        if depth > 1:
                            running[me] = depth - 1
                        else:
                            del running[me]
                        if not started[0]:
                            pending[:0] = [entry]
                        _close_callbacks_done.notify_all()
        if stop is not None:
            try:
                raise stop
            finally:
                stop = None  # the frame would otherwise keep the exception and its traceback


# Guards every device's close-callback list (registration is rare: a cache's first object for a
# device). One lock for all devices, since a backend's __init__ need not call the base class's.
# A close that finds another thread running the callbacks waits on the condition for them.
_close_callbacks_lock = threading.Lock()
_close_callbacks_done = threading.Condition(_close_callbacks_lock)


def _forget_close_lock_in_child() -> None:
    """After fork(), in the child: the lock may have been held by a parent's thread that is not
    in the child, where the child's own devices must still register and close."""
    global _close_callbacks_lock, _close_callbacks_done
    _close_callbacks_lock = threading.Lock()
    _close_callbacks_done = threading.Condition(_close_callbacks_lock)


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork()
    os.register_at_fork(after_in_child=_forget_close_lock_in_child)


def _run_callback(device: "Device", callback: Callable[["Device"], Any], started: Optional[list] = None) -> None:
    """``callback(device)``; a failure becomes a warning, as :func:`close_quietly` makes one.
    ``started``: a one-item list set True just before the call (with no call in between)."""
    try:
        if started is not None:
            started[0] = True
        callback(device)
    except Exception as exc:  # noqa: BLE001 - a device's close never raises over a callback
        warnings.warn(f"a close callback of {device!r} failed: {type(exc).__name__}: {exc}", RuntimeWarning,
                      stacklevel=3)


def typed_view(raw: np.ndarray, dtype: Any, offset: int, count: int | None, access: str) -> np.ndarray:
    """A ``dtype`` view of ``count`` items of the uint8 array ``raw`` from byte ``offset``.

    Shared by every backend's :meth:`HostBuffer.view`; refuses ranges outside the buffer."""
    if access not in ("r", "w", "rw"):
        raise ValueError(f"access must be 'r', 'w' or 'rw', got {access!r}")
    dtype = as_dtype(dtype)
    nbytes = raw.nbytes
    if count is None:
        count = (nbytes - offset) // dtype.itemsize
    end = offset + count * dtype.itemsize
    if offset < 0 or count < 0 or end > nbytes:
        raise ValueError(f"a view of {count} x {dtype} at byte {offset} needs bytes [{offset}, {end}) but the "
                         f"buffer holds {nbytes}; ask for fewer items or a smaller offset")
    out = raw[offset:end].view(dtype)
    if access == "r":
        out = out.view()
        out.flags.writeable = False
    return out


def device_names(mine: "Device", other: "Device") -> tuple[str, str]:
    """The labels of two devices that are not one object, for a message naming both: ``other``'s
    says it is another object where one label cannot tell them apart (two ``CudaDevice(0)``)."""
    from . import device_label

    here, there = device_label(mine), device_label(other)
    if there == here:
        there = f"another device object that is also {there} (make the device once and use that one object)"
    return here, there


def check_event_device(stream: Stream, event: Event, event_device: "Device") -> None:
    """Refuse ``stream.wait(event)`` where ``event`` was recorded on ``event_device``, another
    device than the stream's. CUDA's driver would take it (``cuStreamWaitEvent`` orders work
    across devices), but the simulated GPU cannot: each simulated device has its own virtual clock
    and its own happens-before checker. So neither backend takes it, with the same words, and code
    written against one backend does not fail only on the other.

    Raises:
        ValueError: ``event_device`` is not ``stream``'s device (the message names both, and says
            to order the two through the host).
    """
    mine = stream.owner
    if event_device is mine:
        return
    here, there = device_names(mine, event_device)
    raise ValueError(f"{stream!r} of {here} cannot wait for {event!r}, recorded on {there}: a stream waits only for "
                     f"events of its own device (the simulated GPU cannot order one device's work after another's, "
                     f"so neither backend takes such a wait); order the two through the host instead: event.sync(), "
                     f"then enqueue the work on this stream")


def check_own_stream(device: "Device", stream: Stream) -> Stream:
    """``stream``, if it is one of ``device``'s streams.

    Raises:
        TypeError: it queues another device's work (an event there cannot order this one's).
    """
    if stream.owner is not device:
        here, there = device_names(device, stream.owner)
        raise TypeError(f"stream must be a stream of {here}, got one of {there}: an event on another device's "
                        "stream cannot order this device's work")
    return stream
