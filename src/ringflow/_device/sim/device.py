"""The simulated GPU: a :class:`~ringflow._device.protocol.Device` on virtual time.

Not a mock. Streams are FIFO queues on an event-driven engine whose copy engines, compute
and link have the bandwidths and latencies of a measured profile; data moves only when an
operation completes; every access is checked for happens-before against every earlier
conflicting one (release included). Host calls cost the profile's enqueue overheads, and
virtual time advances only inside host calls (an enqueue's overhead, a sync, a wait), so a
run is a pure function of the calls made and, with ``chaos=True``, of the ``seed``.

``checked=True`` (default) runs the happens-before checker and poisons fresh and released
memory; ``checked=False`` only simulates (for large timing sweeps).

Each device stands on a :class:`~.host.SimHost`, whose host copy rate its copies share with the
other devices of that host that are declared copying (:meth:`SimDevice.sharing_host`); the
process's ``"sim:N"`` devices share one host, and any other simulated GPU has a host of its own.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import os
import threading
import weakref
from typing import Any, Callable, Sequence

import numpy as np
from numpy.lib.array_utils import byte_bounds

from ..._errors import DeviceError, OutOfMemoryError
from ..host_pool import owner_of, without_pooled
from ..._checks import check_flag, check_wait_timeout
from ..protocol import (ArrayArg, Capabilities, Device, LiveCounts, check_nbytes, check_priority, check_seconds, copy_threads,
                        parallel_copy, python_copy_threads)
from .engine import Engine, Op
from .hazard import AccessKind, HappensBeforeChecker
from .host import SimHost
from .memory import SimDeviceBuffer, SimHostBuffer
from .pool import SimWorkerPool
from ..hardware import HardwareProfile, get_profile
from .graph import SYNC_IN_CAPTURE, capturing_thread
from .stream import SimEvent, SimStream


class _ParentsLock:
    """A simulated GPU's lock in a child forked after the device was made: every call that takes
    it raises. The parent's threads that might have held the lock at fork() are not in the child,
    so waiting for it could last for ever; and the device's timeline, streams and memory are the
    parent's, as a GPU's context is (CUDA cannot be used in such a child either)."""

    def __init__(self, what: str):
        self.what = what

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        raise RuntimeError(f"this simulated GPU was made in a parent process before fork() ({self.what}); its "
                           "timeline, streams and memory belong to that process, as a GPU's context does: make a "
                           "new device in the child (ringflow.device('sim'))")

    __enter__ = acquire

    def __exit__(self, *exc_info: Any) -> None:
        return None

    def release(self) -> None:
        return None


# What a thread does whose take of a device's lock has to wait: a plain wait unless the pipeline
# says otherwise (set_blocked_take). The simulated GPU runs a host task's callable, and a kernel's,
# on the thread that advances it, holding this lock: a stage that does not return keeps it, and
# the main thread's Ctrl-C in a call that waits for it must be able to get out (the pipeline's
# shield holds the Ctrl-C back until a checkpoint, which a plain wait never reaches).
_blocked_take: "Callable[[Any], bool] | None" = None


def set_blocked_take(take: "Callable[[Any], bool] | None") -> None:
    """Have every simulated GPU's lock, where its take has to wait, call ``take(lock)`` (which
    takes the underlying RLock, or raises having taken nothing); None: a plain wait."""
    global _blocked_take
    _blocked_take = take


class _DeviceLock:
    """A simulated GPU's lock: a re-entrant lock taken at once where free; where another thread
    keeps it, taken as :func:`set_blocked_take` says."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(False):
            return True
        take = _blocked_take
        if not blocking or timeout != -1 or take is None:
            return self._lock.acquire(blocking, timeout)
        return take(self._lock)

    __enter__ = acquire

    def release(self) -> None:
        self._lock.release()

    def __exit__(self, *exc_info: Any) -> None:
        self._lock.release()


_MADE: "weakref.WeakSet[SimDevice]" = weakref.WeakSet()  # every simulated GPU of this process


def _refuse_in_child() -> None:
    """After fork(), in the child: every simulated GPU made so far is the parent's."""
    for dev in list(_MADE):
        dev._lock = dev.host._lock = _ParentsLock(repr(dev))


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork()
    os.register_at_fork(after_in_child=_refuse_in_child)


class _NullChecker:
    """Stands in for the checker when ``checked=False``: clocks and history are not kept."""

    checked = 0

    def add_actor(self, actor, name):
        pass

    def tick(self, actor):
        return 0

    def snapshot(self, actor):
        return {}

    def merge(self, actor, snapshot):
        pass

    def restart(self, actor, snapshot):
        pass

    def has_seen(self, snapshot, actor):
        return True  # no clocks: a pool needs one actor

    def access(self, *a, **k):
        return None

    def forget(self, buffer):
        pass

    def retire(self, actor):
        pass


class _RetireWhenCollected:
    """Retires a host thread's checker actor when collected (its thread's locals go when the
    thread ends)."""

    __slots__ = ("retire", "actor")

    def __init__(self, checker: Any, actor: Any):
        self.retire, self.actor = checker.retire, actor

    def __del__(self) -> None:
        self.retire(self.actor)


def check_sim_flags(seed: Any, chaos: Any, checked: Any) -> tuple[int, bool, bool]:
    """A simulated GPU's ``seed``, ``chaos`` and ``checked`` as a plain int and bools.

    Raises:
        TypeError: ``seed`` is not an int; ``chaos`` or ``checked`` is not a bool.
        ValueError: ``seed`` is negative.
    """
    # the seed is what makes a chaotic run repeat (None would seed from the OS), and a flag
    # given as a string is true whatever it says
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"ringflow.device('sim'): seed must be an int (the same seed, the same virtual "
                        f"timeline), got {type(seed).__name__} {seed!r}")
    if seed < 0:
        # random.Random seeds from an int's absolute value: -5 would run the timeline of 5
        raise ValueError(f"ringflow.device('sim'): seed must be an int >= 0 (the same seed, the same virtual "
                         f"timeline), got {int(seed)}")
    return (int(seed), check_flag("ringflow.device('sim'): chaos", chaos),
            check_flag("ringflow.device('sim'): checked", checked))


class SimDevice(Device):
    backend = "sim"
    launch_errors_on_events = True  # a compute runs at its turn, and its error lands on the stream

    def __init__(self, profile: "str | os.PathLike | HardwareProfile" = "h200-pcie5", *, seed: int = 0,
                 chaos: bool = False, checked: bool = True, host: "SimHost | None" = None):
        """A simulated GPU on ``profile``: a built-in profile's name (``h200-pcie5``,
        ``pcie4-x16``, ``unit``), a :class:`~ringflow._device.hardware.HardwareProfile`, or the
        path of a profile JSON file (``ringflow doctor --save`` writes one on a real GPU), to see
        what a job would do on that machine. ``host``: the :class:`~.host.SimHost` it shares
        with other simulated GPUs (None: a host of its own).

        Raises:
            ValueError: an unknown name, or a file that is not a valid profile (the message
                names the file and the field); ``seed`` is negative.
            TypeError: ``profile`` is none of these; ``seed`` is not an int; ``chaos`` or
                ``checked`` is not a bool.
        """
        self.seed, self.chaos, self.checked = check_sim_flags(seed, chaos, checked)
        self.profile = get_profile(profile)
        self.name = f"simulated {self.profile.name}"
        self.poison = self.checked
        self.host = host if host is not None else SimHost()
        self._engine = Engine(self.profile, seed=self.seed, chaos=self.chaos)
        self._checker = HappensBeforeChecker() if self.checked else _NullChecker()
        self._lock = _DeviceLock()
        self._tls = threading.local()
        self._host_threads = itertools.count()  # numbers the host threads the checker has seen
        self._live = {"host_buffers": 0, "device_buffers": 0, "streams": 0, "events": 0}
        # every buffer and stream not yet closed, as a weak reference by (live-count kind, id);
        # the device memory in use (see allocate): the bytes of every device buffer not yet
        # freed; the engine queue of every stream not yet closed, by the same keys. The keys of
        # objects collected unclosed are queued by their weak references' callbacks and taken
        # off under the lock (a collection may run while any thread holds it, so a callback must
        # not take it)
        self._held: dict[tuple, weakref.ref] = {}
        self._device_bytes = 0
        self._device_held: dict[tuple, int] = {}
        self._stream_queues: dict[tuple, Any] = {}
        self._collected: collections.deque = collections.deque()
        # of those, the ones that were still open when collected, by kind (collected_unclosed)
        self._unclosed = {"host_buffers": 0, "device_buffers": 0, "streams": 0}
        self._sticky: DeviceError | None = None
        self._in_engine = False
        self._closed = False
        self._captures: dict = {}  # stream -> the SimCapture it is part of
        self._free_host_calls = 0  # > 0 while a graph launch replays its calls (one overhead for all)
        _MADE.add(self)

    def __repr__(self) -> str:
        return f"<SimDevice {self.profile.name} seed={self.seed} chaos={self.chaos}>"

    @property
    def hardware(self) -> HardwareProfile:
        """The profile this simulated GPU runs on (the same model the planner uses)."""
        return self.profile

    # -- the protocol ------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        p = self.profile
        return Capabilities(name=self.name, backend="sim", compute_capability=p.compute_capability,
                            sm_count=p.sm_count, async_engine_count=p.async_engine_count, concurrent_kernels=True,
                            memory_pools=True, stream_priorities=(0, -5), host_register=True,
                            unified_addressing=True, total_memory=p.total_memory)

    @property
    def now(self) -> float:
        return self._engine.now

    def create_stream(self, priority: int = 0) -> SimStream:
        with self._lock:
            self._check_usable()
            priority = check_priority(priority, self.capabilities)
            self._forget_collected()
            stream = SimStream(self, priority)
            self._hold(stream, "streams")
            return stream

    def allocate_host(self, nbytes: int) -> SimHostBuffer:
        nbytes = check_nbytes(nbytes, "allocate_host size")
        with self._lock:
            self._check_usable()
            buf = SimHostBuffer(self, nbytes)  # may raise MemoryError: count only what exists
            self.host.pin(buf)
            self._hold(buf, "host_buffers")
            return buf

    def register_host(self, array: np.ndarray) -> SimHostBuffer:
        if not isinstance(array, np.ndarray):
            raise TypeError(f"register_host takes a numpy array, got {type(array).__name__}")
        if not array.flags.c_contiguous:
            raise ValueError("register_host needs a C-contiguous array; pass np.ascontiguousarray(a) "
                             "or stage the data through allocate_host")
        nbytes = check_nbytes(array.nbytes, "registered array size")
        with self._lock:
            self._check_usable()
            buf = SimHostBuffer(self, nbytes, array)
            self.host.pin(buf)  # may raise DeviceError: memory another device of the host pinned
            self._hold(buf, "host_buffers")
            self._host_api(self.profile.register_seconds(nbytes))  # (its unpinning is charged at close)
            return buf

    def allocate(self, nbytes: int, stream: SimStream | None = None) -> SimDeviceBuffer:
        """Device memory (see :meth:`Device.allocate`), out of the profile's total memory.

        The device keeps count of the bytes in use (:attr:`memory_in_use`) and refuses an
        allocation that would take them past the total, as a real GPU does. The count is kept
        simple: a buffer's bytes are in use from this call until it is freed: closed (a refused
        close frees nothing), collected unclosed, or gone with the device's close. A
        stream-ordered allocation (``stream=...``) counts from the call, before its stream
        reaches it, and a stream-ordered free (``close(stream=...)``) gives its bytes back at the
        call, before its stream reaches it (the pool hands them to allocations ordered after the
        free; the count does not tell those from others). A real GPU also keeps memory for the
        context, rounds sizes up and shares its memory with other processes, so it may refuse
        sooner than this count does.

        Raises:
            OutOfMemoryError: (a ``MemoryError`` and a ``DeviceError``, not sticky) ``nbytes``
                is more than the profile's total memory, or more than it has free beside the
                memory in use; the device stays usable (the pipeline names the option that sized
                a ring too large).
        """
        nbytes = check_nbytes(nbytes, "allocate size")
        with self._lock:
            self._check_usable()
            capture = capturing_thread(self)
            if capture is not None:  # as a real GPU refuses it on the capturing thread
                raise capture.abandon(f"allocating {nbytes} bytes of device memory on the capturing thread")
            if stream is not None:
                if not isinstance(stream, SimStream) or stream._dev is not self:
                    raise ValueError(f"allocate(stream=...) needs a stream of this device, got {stream!r}")
                stream._begin(0.0)
            self._check_device_memory(nbytes)
            buf = SimDeviceBuffer(self, nbytes)
            if stream is not None:
                # A stream-ordered allocation is usable on its stream at once and on another stream
                # only once that stream is ordered after it: record it as that stream's write.
                buf._access(AccessKind.WRITE, 0, nbytes, "stream-ordered allocate", actor=stream.actor)
            self._hold(buf, "device_buffers")  # counted only once it exists (numpy may refuse it too)
            return buf

    @property
    def memory_in_use(self) -> int:
        """Bytes of device memory held by buffers not yet freed (see :meth:`allocate`)."""
        with self._lock:
            self._forget_collected()
            return self._device_bytes

    def create_worker_pool(self, workers: int) -> SimWorkerPool:
        with self._lock:
            self._check_usable()
            return SimWorkerPool(self, workers)

    def publish(self) -> dict:
        actor = self._own_clock_actor()
        if actor is not None:
            return self._checker.snapshot(actor)
        with self._lock:
            return self._checker.snapshot(self._actor())

    def observe(self, token: Any) -> None:
        if token is None:
            return
        actor = self._own_clock_actor()
        if actor is not None:
            self._checker.merge(actor, token)
            return
        with self._lock:
            self._checker_merge(token)

    def _own_clock_actor(self):
        """The calling host thread's checker actor, when it already has one and acts as itself
        (no pool task or stream op running on it); else None.

        Such a clock is changed and read only by its own thread (every access, wait and merge
        names the calling thread's actor), so a hand-off's publish or observe copies or merges it
        without the device's lock. That lock is held while a simulated call runs the stages it
        reaches, a user's compute included: an event loop's thread handing a cancel or a result
        over must not wait for one, as it waits for none on a GPU."""
        if getattr(self._tls, "actor", None) is not None:
            return None
        return getattr(self._tls, "host_actor", None)

    def fold_tokens(self, tokens: list) -> list:
        # a token is a vector clock; one that another covers entry by entry adds nothing to it
        kept: list = []
        for t in tokens:
            if t is None or any(_covers(k, t) for k in kept):
                continue
            kept = [k for k in kept if not _covers(t, k)]
            kept.append(t)
        return kept

    def wait_any(self, waitables: Sequence[Any], timeout: float | None = None,
                 wake: "threading.Event | None" = None) -> list[Any]:
        waitables = list(waitables)
        if not waitables:
            raise ValueError("wait_any needs at least one event or host task")
        timeout = check_wait_timeout(timeout)
        ops = [self._op_of(w) for w in waitables]
        for w in waitables:
            owner = w._dev if isinstance(w, SimEvent) else getattr(getattr(w, "_pool", None), "_dev", None)
            if owner is not self:
                raise ValueError(f"wait_any got {w!r} of another device; wait only on this device's events and tasks")
        with self._lock:
            self._host_api(self.profile.event_overhead_s)
            until = math.inf if timeout is None else self._engine.now + timeout
            if wake is None:
                self._block_until(lambda: any(op.done for op in ops), what="wait_any", until=until)
            else:  # another thread's new work ends the wait (virtual time stops where it is)
                self._block_until(lambda: wake.is_set() or any(op.done for op in ops), what="wait_any", until=until)
            done = [w for w, op in zip(waitables, ops) if op.done]
            for w in done:
                self._checker_merge(w._snapshot if isinstance(w, SimEvent) else w._end_clock)
            return done

    def runs_caller(self) -> bool:
        # the thread that advances the engine holds the lock (re-entrant) throughout: one that
        # cannot take it at once runs none of this device's work; a forked child's lock raises,
        # and the child's next device call says so
        try:
            if not self._lock.acquire(False):
                return False
        except RuntimeError:
            return False
        try:
            return self._in_engine
        finally:
            self._lock.release()

    def sleep(self, seconds: float) -> None:
        seconds = check_seconds(seconds, "sleep(seconds)")
        with self._lock:
            if self._in_engine:
                raise RuntimeError("a host task on the simulated GPU must not sleep; use charge(seconds)")
            self._check_usable()
            self._run_engine(self._engine.now + seconds)

    def device_source(self, obj: Any) -> "tuple | None":
        """A launch argument (``buffer.array(dtype, shape)``) of one of this device's buffers,
        standing for a framework's device array; its producer's work must be done (or ordered
        before the submit) when it is submitted."""
        if isinstance(obj, ArrayArg) and isinstance(obj.where.buffer, SimDeviceBuffer) and obj.where.buffer._dev is self:
            return obj.where, obj.shape, obj.dtype, None
        return None

    def host_copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        # bytes of this device's pinned pool copied from or to are checked host accesses, as a
        # host view of them is: a copy into a staging block whose last h2d has not completed,
        # or out of a block a d2h still writes, is a hazard
        for array, access in ((src, "r"), (dst, "w")):
            _check_pooled(self, array, access)
        parallel_copy(dst, src, copy_threads(dst.nbytes))  # the real GPU's copy, split as it splits it
        if dst.nbytes:  # charged at a split that does not depend on this machine (see python_copy_threads)
            self.sleep(dst.nbytes / (self.host.copy_rate(self, python_copy_threads(dst.nbytes)) * 1e9))

    def sharing_host(self, threads: int) -> "contextlib.AbstractContextManager[None]":
        """Declare, until the block ends, that this device copies host memory with ``threads``
        threads alongside the other devices of its host (:class:`~.host.SimHost`): their
        copies get their share of the host's copy rate meanwhile. Its own copies' rate is
        unchanged by it.

        Raises:
            ValueError: ``threads`` is not an int >= 0.
        """
        return self.host.sharing(self, threads)

    def live(self) -> LiveCounts:
        """What is open (see :meth:`Device.live`); a buffer collected unclosed is not, as on a
        GPU, which frees an allocation whose last reference goes."""
        with self._lock:
            self._forget_collected()
            counts = LiveCounts(**self._live)
        return without_pooled(self, counts)

    def collected_unclosed(self) -> dict[str, int]:
        """How many buffers and streams (``host_buffers``, ``device_buffers``, ``streams``) were
        released because they were garbage-collected while still open, since the device was
        made. A checking aid: ringflow closes every buffer and stream it makes itself, on every
        path (a failure and Ctrl-C included), so in a test that drops none of its own these stay
        zero; a clean-up left to the collector shows here where :meth:`live` cannot see it."""
        with self._lock:
            self._forget_collected()
            return dict(self._unclosed)

    def synchronize(self) -> None:
        """Run every enqueued operation to completion (device-wide; tests and close only).

        Raises:
            CaptureError: called on a thread whose stream captures a graph (directly, or from a
                callable launched while captured), which abandons the capture: a GPU refuses to
                synchronise during a stream capture.
        """
        with self._lock:
            capture = capturing_thread(self)
            if capture is not None:
                raise capture.abandon(f"synchronising the device while {capture.origin.name} captures on this thread; "
                                      f"{SYNC_IN_CAPTURE}")
            self._block_until(self._engine.idle, what="device synchronize")

    def close(self) -> None:
        """Run the enqueued work, then release the device's memory and run the :meth:`on_close`
        callbacks. Harmless twice: a later close runs the callbacks a Ctrl-C left, or waits for
        another thread's close to have run them."""
        if self._closed:
            self._run_close_callbacks()
            return
        try:
            self.synchronize()
        except Exception:  # noqa: BLE001 - closing must not raise over a user's error
            pass
        self._closed = True
        # the context's memory goes with it (buffers closed later give back nothing). Not under
        # the lock: in a forked child the lock raises, and close must not; once _closed is set no
        # allocate gets past _check_usable to add to these
        self._device_held.clear()
        self._device_bytes = 0
        self._run_close_callbacks()

    # -- test hooks ----------------------------------------------------------------------------
    def inject_sticky_error(self, message: str = "simulated illegal address in a kernel") -> None:
        """Break the context as a faulting kernel would: every later call raises DeviceError."""
        with self._lock:
            self._sticky = DeviceError(f"sticky device error: {message}; the CUDA context is unusable, "
                                       "restart the process to use the GPU again", sticky=True)

    @property
    def checks(self) -> int:
        """How many accesses the happens-before checker has checked so far."""
        return self._checker.checked

    @property
    def ops_completed(self) -> int:
        return self._engine.completed

    def add_op_observer(self, fn: Callable[[Op], None]) -> None:
        self._engine.on_op_done.append(fn)

    # -- internals shared by streams, buffers and pools ------------------------------------------
    def _sticky_error(self) -> DeviceError:
        """A new DeviceError for each call that meets the dead context (as each failing CUDA call
        returns its own error), caused by the first: raising one shared object again and again
        would leave it with the traceback of whichever raise came last."""
        err = DeviceError(str(self._sticky), sticky=True)
        err.__cause__ = self._sticky
        return err

    def _check_device_memory(self, nbytes: int) -> None:
        """Refuse an allocation of ``nbytes`` that the memory in use leaves no room for (the
        device's lock held)."""
        total = self.profile.total_memory
        if nbytes > total:
            raise OutOfMemoryError(f"allocate(nbytes) asks for {nbytes} bytes of device memory, more than the "
                                   f"device's total memory of {total} bytes ({self.profile.name}); ask for fewer bytes")
        self._forget_collected()
        in_use = self._device_bytes
        if in_use + nbytes > total:
            raise OutOfMemoryError(
                f"allocate(nbytes) asks for {nbytes} bytes of device memory, but {in_use} bytes of the device's "
                f"total memory of {total} bytes are in use ({total - in_use} free; {self.profile.name}); free "
                f"device memory first (close the buffers, pipelines and jobs you no longer need: they hold device "
                f"memory until closed) or ask for fewer bytes")

    def _hold(self, obj: "SimHostBuffer | SimDeviceBuffer | SimStream", kind: str) -> None:
        """Count ``obj`` as live (``kind``: "host_buffers", "device_buffers" or "streams"), a device
        buffer's bytes as in use and a stream's queue as the engine's, until it is closed or
        collected (the device's lock held)."""
        key, gone = (kind, obj.id), self._collected  # (buffers and streams are numbered apart)
        # the callback holds neither the device nor the object, only the queue and the key
        self._held[key] = weakref.ref(obj, lambda _: gone.append(key))
        self._live[kind] += 1
        if kind == "device_buffers":
            self._device_held[key] = obj.nbytes
            self._device_bytes += obj.nbytes
        elif kind == "streams":
            self._stream_queues[key] = obj._queue

    def _release(self, kind: str, obj_id: int) -> None:
        """The ``kind`` object of id ``obj_id`` was closed or collected: it is no longer live, a
        device buffer's memory no longer in use and a stream's queue no longer visited (the
        device's lock held; no bytes after the device closed, which took all of them back).
        Harmless for an object already released."""
        key = (kind, obj_id)
        if self._held.pop(key, None) is not None:
            self._live[kind] -= 1
        nbytes = self._device_held.pop(key, None)
        if nbytes is not None:
            self._device_bytes -= nbytes
        queue = self._stream_queues.pop(key, None)
        if queue is not None:
            self._engine.remove_queue(queue)
            self._checker.retire(("stream", obj_id))  # it enqueues nothing more

    def _forget_collected(self) -> None:
        """Release the buffers and streams collected unclosed (the device's lock held): a real GPU
        frees an allocation, and destroys a stream, whose last reference goes."""
        while self._collected:
            kind, obj_id = self._collected.popleft()
            if (kind, obj_id) in self._held:
                self._unclosed[kind] += 1
            self._release(kind, obj_id)

    def _check_usable(self) -> None:
        if self._sticky is not None:
            raise self._sticky_error()
        if self._closed:
            raise RuntimeError("this simulated device is closed; create a new one with ringflow.device('sim')")

    def _actor(self):
        override = self._tls_actor_override()
        if override is not None:
            return override
        actor = getattr(self._tls, "host_actor", None)
        if actor is None:
            # a number of its own, not the thread's id: Python gives an ended thread's id to a
            # new thread, which would then start out knowing all the ended one had seen
            actor = self._tls.host_actor = ("thread", next(self._host_threads))
            self._checker.add_actor(actor, f"host thread {threading.current_thread().name}")
            # the thread's locals go when it ends, and with them this: its actor is retired
            self._tls.retire_actor = _RetireWhenCollected(self._checker, actor)
        return actor

    def _tls_actor_override(self):
        return getattr(self._tls, "actor", None)

    def _set_actor_override(self, actor) -> None:
        self._tls.actor = actor

    def _checker_merge(self, snapshot: dict) -> None:
        self._checker.merge(self._actor(), snapshot)

    def _check_access(self, buf, kind: AccessKind, start: int, end: int, op: str, actor=None, tick=True) -> None:
        if kind is AccessKind.RELEASE and (self._sticky is not None or self._closed):
            # the context is dead, or closed (its close ran every operation to completion,
            # perhaps on another thread than this release's): no operation will ever run again,
            # so none can race with a release (and no event can be synced to order it); freeing
            # is always safe now
            self._checker.forget(("buf", buf.id))
            return
        self._checker.access(actor if actor is not None else self._actor(), kind, ("buf", buf.id), buf.label,
                             start, end, op, tick=tick)

    def _host_api(self, seconds: float = 0.0) -> None:
        """A host call: fail if the context is broken, and spend its host overhead."""
        self._check_usable()
        if seconds > 0 and not self._in_engine and not self._free_host_calls:
            self._run_engine(self._engine.now + seconds)

    @contextlib.contextmanager
    def _host_calls_free(self):
        """Host calls made inside cost no overhead (a graph launch's replayed calls)."""
        self._free_host_calls += 1
        try:
            yield
        finally:
            self._free_host_calls -= 1

    def _run_engine(self, until: float, stop: Callable[[], bool] | None = None) -> bool:
        self._in_engine = True
        try:
            return self._engine.advance(until, stop)
        finally:
            self._in_engine = False

    def _block_until(self, cond: Callable[[], bool], *, what: str, until: float = math.inf) -> None:
        if self._in_engine:
            raise RuntimeError(f"{what}: a host task on the simulated GPU must not block; "
                               "return and let the pipeline wait instead")
        self._check_usable()
        self._run_engine(until, cond)
        if self._sticky is not None:
            raise self._sticky_error()

    def _new_event(self, op: Op, snapshot: dict, timing: bool, stream_name: str) -> SimEvent:
        ev = SimEvent(self, op, snapshot, timing, stream_name)
        self._live["events"] += 1
        weakref.finalize(ev, self._event_gone)
        return ev

    def _event_gone(self) -> None:
        self._live["events"] -= 1

    @staticmethod
    def _op_of(w: Any) -> Op:
        op = getattr(w, "_op", None) or getattr(w, "op", None)
        if not isinstance(op, Op):
            raise TypeError(f"wait_any takes events and host tasks of this device, got {type(w).__name__}")
        return op


def _covers(a: dict, b: dict) -> bool:
    """Whether vector clock ``a`` has seen everything ``b`` has."""
    return all(a.get(actor, 0) >= n for actor, n in b.items())


def _check_pooled(dev: "SimDevice", array: Any, access: str) -> None:
    """A checked host access (``access``: ``"r"`` or ``"w"``) of the bytes ``array`` spans, if they
    are memory of ``dev``'s host pool."""
    owner = owner_of(array) if isinstance(array, np.ndarray) and array.nbytes else None
    if owner is None or owner.pool.device is not dev:
        return
    buffer = owner.block.buffer
    low, high = byte_bounds(array)
    start = low - buffer._memory().__array_interface__["data"][0]
    buffer.view(np.uint8, offset=start, count=high - low, access=access)
