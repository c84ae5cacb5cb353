"""Streams and events on a CUDA GPU (cuda.core ``Stream`` / ``Event``).

Ordering facts:

* Every stream is created non-blocking: it never synchronises with the legacy default stream,
  so work that other libraries put there cannot stall a pipeline.
* Copies, fills and launches return once enqueued. ``Stream.launch`` calls ``fn`` at enqueue
  time, on the calling thread, with the framework's current stream set to this stream: the
  kernels ``fn`` enqueues run in this stream's order, after everything enqueued before.
* An event is done once every operation enqueued on its stream before ``record`` has
  completed; observing it done (``is_done``, ``sync``, ``Device.wait_any``) orders the host
  after that work. Events are made without timing unless ``timing=True``.
"""

from __future__ import annotations

import functools
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ..._checks import is_c_scalar, launch_scalar
from ..._errors import CaptureError, DeviceError
from ..protocol import CAPTURED_ALLOCATION_ADVICE, ArrayArg, Buffer, BufferSlice, Event, Graph, Stream, as_slice, check_event_device, copy_extent
from ._lib import as_device_error, check, core, device_error, driver, is_sticky, translate
from .arrays import framework_allocations, using_stream

if TYPE_CHECKING:
    from .device import CudaDevice


IDLE_EVENTS_MAX = 4096  # untimed CUDA events a device keeps for reuse (a pipeline holds a few per slot)


class CudaEvent(Event):
    """A recorded cuda.core event. A sticky device error seen while querying it makes it done,
    with :attr:`error` set, so pollers notice; :meth:`sync` raises it."""

    def __init__(self, device: "CudaDevice", cc_event: Any, timing: bool, stream: "CudaStream"):
        self._device = device
        self._cc = cc_event
        self.timing = timing
        self._stream = stream
        self._error: DeviceError | None = None
        self._done = False  # once True it stays True: completion cannot be undone
        # counted live until closed or collected; one per recorded event, so no finalizer object
        self._counted = True
        device._live.event_tokens.append(None)

    @property
    def stream_name(self) -> str:
        return repr(self._stream)

    @property
    def owner(self) -> "CudaDevice":
        return self._device

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self._device._live.event_tokens.pop()

    def __del__(self) -> None:
        # The last reference is gone, so nothing can query or wait on this event again: an
        # untimed CUDA event goes back to the device for a later record (re-recording overwrites
        # its captured work; waits enqueued earlier keep the state they captured). Never raises.
        # A call drops its events together as it returns, so all of this is written out here,
        # with no further Python call per event. The device's close empties the idle list.
        try:
            cc = self._cc
            dev = self._device
            if cc is not None:
                self._cc = None
                if not self.timing and self._error is None:
                    idle = dev._idle_events
                    if len(idle) < IDLE_EVENTS_MAX and not dev._closed:
                        idle.append(cc)
            if self._counted:
                self._counted = False
                dev._live.event_tokens.pop()
        except Exception:  # noqa: BLE001 - a finaliser must not raise
            pass

    @property
    def is_done(self) -> bool:
        if self._done:
            return True
        if self._cc is None:
            raise RuntimeError(f"{self!r} is closed")
        self._device._ensure_current()
        try:
            # polled in a loop by the progress thread: the error's wording is made only on failure
            self._done = bool(self._cc.is_done)
        except Exception as exc:  # noqa: BLE001 - what translate does, without a context per query
            err = as_device_error(lambda: f"querying {self!r}", exc)
            if err is None:
                raise
            self._error, self._done = err, True
        return self._done

    def sync(self) -> None:
        if self._error is not None:
            raise self._error
        if self._done:
            return
        if self._cc is None:
            raise RuntimeError(f"{self!r} is closed")
        self._device._ensure_current()
        try:
            with translate(lambda: f"waiting for {self!r}"):
                self._cc.sync()
        except DeviceError as exc:
            self._error, self._done = exc, True
            raise
        self._done = True

    @property
    def error(self) -> BaseException | None:
        return self._error

    def elapsed_since(self, earlier: Event) -> float:
        if not isinstance(earlier, CudaEvent) or earlier._device is not self._device:
            raise TypeError("elapsed_since needs another event recorded on the same CUDA device")
        if not (self.timing and earlier.timing):
            raise ValueError("elapsed_since needs two timing events: record both with stream.record(timing=True)")
        if not (self.is_done and earlier.is_done):
            raise RuntimeError("both events must be done before reading the time between them; sync() them first")
        if self._cc is None or earlier._cc is None:
            raise RuntimeError("one of the events is closed")
        with translate("reading the time between two events"):
            return (self._cc - earlier._cc) / 1e3  # cuda.core returns milliseconds

    def close(self) -> None:
        """Release the CUDA event now instead of at collection. Harmless twice."""
        if self._cc is None:
            return
        cc, self._cc = self._cc, None
        try:
            cc.close()
        except Exception as exc:  # noqa: BLE001 - cleanup never raises
            warnings.warn(f"destroying {self!r} failed: {exc}", RuntimeWarning, stacklevel=2)
        finally:
            self._uncount()

    def __repr__(self) -> str:
        kind = "timing event" if self.timing else "event"
        return f"<CudaEvent {kind} on {self.stream_name}>"


@functools.lru_cache(maxsize=2)
def _event_options(timing: bool) -> Any:
    return core().EventOptions(timing_enabled=timing)


class CudaStream(Stream):
    """A non-blocking cuda.core stream with a priority (lower number = higher priority)."""

    def __init__(self, device: "CudaDevice", priority: int):
        device._ensure_current()
        # a stream closed earlier and now idle, else a new one: a pipeline opens three streams
        # per call, and creating one is a driver call plus a cuda.core object each time
        self._cc = device._take_idle_stream(priority)
        if self._cc is None:
            cc = core()
            with translate(f"creating a stream with priority {priority}"):
                self._cc = device._cc.create_stream(options=cc.StreamOptions(nonblocking=True, priority=priority))
        self._device = device
        self.priority = int(self._cc.priority)
        self.handle = int(self._cc.handle)
        self._framework_streams: dict[str, Any] = {}  # CuPy / PyTorch wrappers of this stream
        self._capture_thread: "int | None" = None  # the thread that began a capture here
        self._closed = False
        self._finalizer = device._live.track(self, "streams")

    # -- helpers -------------------------------------------------------------------------------
    @property
    def owner(self) -> "CudaDevice":
        return self._device

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed; create a new stream instead of reusing a closed one")
        self._device._check_open()

    def _check_buffer(self, s: BufferSlice) -> int:
        buf = s.buffer
        if getattr(buf, "_device", None) is not self._device:
            raise ValueError(f"{buf!r} does not belong to {self._device!r}; copy only between buffers of one device")
        return buf._ptr + s.offset

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol, so other libraries can wrap this stream."""
        self._check_open()
        return (0, self.handle)

    # -- protocol ------------------------------------------------------------------------------
    def record(self, *, timing: bool = False) -> CudaEvent:
        """Returns once enqueued; the event is done when everything enqueued on this stream
        before it has completed. An untimed record reuses a CUDA event whose previous
        :class:`CudaEvent` was collected (creating one costs more than recording it)."""
        if self._closed:
            self._check_open()
        dev = self._device
        dev._ensure_current()
        reuse = None
        if not timing:
            try:  # one pop, not a test then a pop: another thread may take the last one between
                reuse = dev._idle_events.pop()
            except IndexError:
                pass
        try:  # recorded per chunk and stage: translate's work, without a context manager per record
            if reuse is not None:
                ev = self._cc.record(event=reuse)
            else:
                ev = self._cc.record(options=_event_options(bool(timing)))
        except Exception as exc:  # noqa: BLE001 - re-raised, as a DeviceError when it is the device's
            err = as_device_error(lambda: f"recording an event on {self!r}", exc)
            if err is None:
                raise
            raise err from exc
        return CudaEvent(dev, ev, bool(timing), self)

    def wait(self, event: Event) -> None:
        if self._closed:
            self._check_open()
        if type(event) is not CudaEvent:
            raise TypeError(f"{self!r} can only wait for a CudaEvent (recorded on a stream of a CUDA device), "
                            f"got {event!r}")
        check_event_device(self, event, event._device)
        if event._done and event._error is None:
            # the host has seen it complete, so everything enqueued from now on already follows
            # it: the wait would be a no-op costing a driver call (at the start of a call a warm
            # engine's slots wait on its previous call's copies; docs/design.md has the cost)
            return
        cc_event = event._cc
        if cc_event is None:
            raise RuntimeError(f"{event!r} is closed")
        self._device._ensure_current()
        try:  # as in record: translate's work without its context manager
            self._cc.wait(cc_event)
        except Exception as exc:  # noqa: BLE001 - re-raised, as a DeviceError when it is the device's
            err = as_device_error(lambda: f"making {self!r} wait for {event!r}", exc)
            if err is None:
                raise
            raise err from exc

    def copy(self, dst: Buffer | BufferSlice, src: Buffer | BufferSlice, nbytes: int | None = None) -> None:
        """Enqueue a copy in any direction (host<->device, device<->device, host<->host between
        pinned/registered buffers); the driver infers it from the unified addresses."""
        self._check_open()
        d, s = copy_extent(dst, src, nbytes)
        dptr, sptr = self._check_buffer(d), self._check_buffer(s)
        self._device._ensure_current()
        # cuda.core copies whole Buffers only; byte ranges need cuMemcpyAsync from cuda.bindings.
        check(driver().cuMemcpyAsync(dptr, sptr, d.nbytes, self.handle),
              lambda: f"copy of {d.nbytes} bytes from {s.buffer!r} to {d.buffer!r} on {self!r}")

    def fill(self, dst: Buffer | BufferSlice, byte: int) -> None:
        self._check_open()
        if isinstance(byte, bool) or not isinstance(byte, int) or not 0 <= byte <= 255:
            raise ValueError(f"fill value must be a byte (an int in 0..255), got {byte!r}")
        d = as_slice(dst)
        if d.nbytes == 0:
            return
        ptr = self._check_buffer(d)
        self._device._ensure_current()
        # cuda.core fills whole Buffers only; a byte range needs cuMemsetD8Async from cuda.bindings.
        check(driver().cuMemsetD8Async(ptr, byte, d.nbytes, self.handle),
              lambda: f"fill of {d.nbytes} bytes of {d.buffer!r} on {self!r}")

    def launch(self, fn: Callable[..., Any], *args: Any, reads: Iterable[Any] = (), writes: Iterable[Any] = (),
               sim_seconds: float | None = None) -> None:
        """Call ``fn(*args)`` now, on this thread, with each :class:`ArrayArg` turned into the
        device's array type (a CuPy array, a PyTorch tensor, or a DLPack-capable view) over
        that device memory, and with the framework's current stream set to this stream, so
        the kernels ``fn`` enqueues are ordered on it. ``reads``/``writes`` are checked (open,
        this device) but otherwise only matter on the simulator; ``sim_seconds`` is ignored.

        An exception from ``fn`` propagates from here unchanged (the simulator, which runs
        ``fn`` later, reports it through the next event instead), except one that says the
        CUDA context is broken: that becomes a sticky :class:`DeviceError`.
        """
        self._check_open()
        if not callable(fn):
            raise TypeError(f"launch needs a callable, got {type(fn).__name__}")
        for obj in (*reads, *writes):
            self._check_buffer(as_slice(obj))
        dev = self._device
        dev._ensure_current()
        fast = getattr(fn, "__ringflow_launch__", None)
        if fast is not None:
            raw = _raw_kernel_args(args, dev)
            if raw is not None:
                try:
                    fast(self._cc, dev.index, *raw)
                    return
                except DeviceError:
                    raise
                except Exception as exc:
                    if is_sticky(exc):
                        raise device_error(lambda: f"kernel {fn!r} on {self!r}", exc) from exc
                    raise
        adapter = dev._adapter
        converted = []
        for a in args:
            if isinstance(a, ArrayArg):
                self._check_buffer(as_slice(a))
                if a.where.buffer.is_host:
                    raise ValueError("launch takes device memory; copy host data to a device buffer first")
                converted.append(adapter.array(a, dev.index))
            elif isinstance(a, (Buffer, BufferSlice)):
                raise TypeError("pass buffers to launch as typed arrays: buf.array(dtype, shape)")
            else:
                converted.append(a)
        name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
        capturing = bool(dev._capturing) and threading.get_ident() in dev._capturing
        try:
            with using_stream(self), adapter.stream_context(self):
                if capturing:
                    # a framework's cached block would be captured at its address and handed to
                    # someone else after fn returns, while every replay still writes there
                    with framework_allocations(dev.index) as allocated:
                        fn(*converted)
                    if allocated():
                        raise CaptureError(f"compute callable {name} allocated device memory while being "
                                           f"captured; {CAPTURED_ALLOCATION_ADVICE}")
                else:
                    fn(*converted)
        except DeviceError:
            raise
        except Exception as exc:
            if is_sticky(exc):
                raise device_error(f"compute callable {name} on {self!r}", exc) from exc
            raise

    def sync(self) -> None:
        self._check_open()
        self._device._ensure_current()
        with translate(lambda: f"synchronising {self!r}"):
            self._cc.sync()

    # -- graphs --------------------------------------------------------------------------------
    # Capture goes through the driver (cuStreamBeginCapture and friends) on this stream's
    # handle: cuda.core's GraphBuilder cannot end a capture the driver invalidated without
    # raising, and would then try to end it again when collected, possibly in the middle of a
    # later capture on the same (recycled) stream.
    def begin_capture(self) -> None:
        """Capture in thread-local mode: a call on this thread that could synchronise (an
        allocation, a blocking copy, a query of a captured event) fails and invalidates the
        capture instead of running."""
        self._check_open()
        dev = self._device
        me = threading.get_ident()
        if me in dev._capturing:
            raise CaptureError(f"this thread is capturing on {dev!r} already; end that capture first")
        dev._ensure_current()
        d = driver()
        try:
            check(d.cuStreamBeginCapture(self.handle, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                  lambda: f"beginning a capture on {self!r}")
        except DeviceError as exc:
            if exc.sticky:
                raise
            raise CaptureError(str(exc)) from exc
        dev._capturing.add(me)
        self._capture_thread = me

    def end_capture(self) -> "CudaGraph":
        dev = self._device
        dev._capturing.discard(self._capture_thread)
        self._capture_thread = None
        d = driver()
        err, graph = d.cuStreamEndCapture(self.handle)
        if int(err) != 0 or graph is None or int(graph) == 0:
            name = getattr(err, "name", None) or f"CUresult {int(err)}"
            raise CaptureError(f"capture on {self!r} failed: {name} (an operation in it cannot be captured: a "
                               "host synchronisation, an allocation, a wait for an event recorded before the "
                               "capture, or a stream not joined back)")
        try:
            exe = check(d.cuGraphInstantiate(graph, 0), lambda: f"instantiating the graph captured on {self!r}")
        except BaseException:
            d.cuGraphDestroy(graph)
            raise
        return CudaGraph(dev, graph, exe)

    def abort_capture(self) -> None:
        dev = self._device
        try:
            if self._capture_thread is None:
                return
            dev._capturing.discard(self._capture_thread)
            self._capture_thread = None
            d = driver()
            err, status = d.cuStreamIsCapturing(self.handle)
            if int(err) == 0 and int(status) != int(d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE):
                err, graph = d.cuStreamEndCapture(self.handle)
                if graph is not None and int(graph) != 0:
                    d.cuGraphDestroy(graph)
        except Exception as exc:  # noqa: BLE001 - cleanup never raises
            warnings.warn(f"abandoning the capture on {self!r} failed: {type(exc).__name__}: {exc}",
                          RuntimeWarning, stacklevel=2)

    def close(self) -> None:
        """Close the stream. Work already enqueued still runs to completion (CUDA's rule); the
        device may hand the same CUDA stream to a later ``create_stream`` once that work is
        done. Closing twice is harmless and never raises."""
        if self._closed:
            return
        self._closed = True
        self._framework_streams.clear()
        try:
            # Work already enqueued still runs; the CUDA stream goes to the device's idle list
            # and is handed to a later create_stream only once that work is done (or destroyed)
            if not self._device._recycle_stream(self._cc, self.priority):
                self._cc.close()
        except Exception as exc:  # noqa: BLE001 - cleanup never raises
            warnings.warn(f"destroying {self!r} failed: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
        finally:
            self._device._live.forget(self)
            self._finalizer()

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<CudaStream {self.handle:#x} priority {self.priority} on cuda:{self._device.index}{state}>"


class CudaGraph(Graph):
    """An instantiated CUDA graph (``CUgraphExec``) and the graph it was made from."""

    def __init__(self, device: "CudaDevice", graph: Any, exe: Any):
        self._device = device
        self._graph = graph
        self._exe = exe

    @property
    def closed(self) -> bool:
        return self._exe is None

    def launch(self, stream: Stream) -> None:
        if self._exe is None:
            raise RuntimeError(f"{self!r} is closed")
        if type(stream) is not CudaStream or stream._device is not self._device:
            raise ValueError(f"a graph launches on a stream of its own device, got {stream!r}")
        stream._check_open()
        self._device._ensure_current()
        check(driver().cuGraphLaunch(self._exe, stream.handle), lambda: f"launching {self!r} on {stream!r}")

    def close(self) -> None:
        exe, self._exe = self._exe, None
        graph, self._graph = self._graph, None
        try:
            d = driver()
            if exe is not None:
                d.cuGraphExecDestroy(exe)
            if graph is not None:
                d.cuGraphDestroy(graph)
        except Exception as exc:  # noqa: BLE001 - cleanup never raises
            warnings.warn(f"destroying {self!r} failed: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)

    def __repr__(self) -> str:
        return f"<CudaGraph on cuda:{self._device.index}{' closed' if self._exe is None else ''}>"


def _raw_kernel_args(args: tuple, device: "CudaDevice") -> "tuple[list, list] | None":
    """For a kernel's fast path: the arguments with each device :class:`ArrayArg` turned into its
    address, and the element counts of those arrays; None when an argument needs the general
    path, which checks it and says what is wrong (a host or closed buffer, another device's,
    anything but an ArrayArg or a numpy scalar)."""
    kernel_args, sizes = [], []
    for a in args:
        if type(a) is ArrayArg:
            where = a.where
            buf = where.buffer
            if buf.is_host or buf.closed or getattr(buf, "_device", None) is not device:
                return None
            kernel_args.append(buf._ptr + where.offset)
            n = 1
            for d in a.shape:
                n *= d
            sizes.append(n)
        elif is_c_scalar(a):  # any other numpy scalar: the general path refuses it by name
            kernel_args.append(launch_scalar(a))
        else:
            return None
    if not sizes:
        return None
    return kernel_args, sizes
