"""Streams and events of the simulated GPU.

Every enqueue is checked by the happens-before checker at the moment it is enqueued, with
the stream's vector clock (which already holds everything the stream waited on), and
becomes an :class:`~.engine.Op` whose data effect happens when it completes in virtual time.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Callable, Iterable


from ..._errors import CaptureError, LaunchError, describe
from ..protocol import (ArrayArg, Buffer, BufferSlice, Event, Stream, as_slice, check_event_device, check_seconds,
                        copy_extent)
from .engine import Op
from .graph import SYNC_IN_CAPTURE, CapturedEvent, SimCapture, SimGraph, capturing_thread
from .hazard import AccessKind
from .pool import SimHostWork
from .tape import HostRead, Tape

if TYPE_CHECKING:
    from .device import SimDevice

_ids = itertools.count(1)


class SimEvent(Event):
    def __init__(self, dev: "SimDevice", op: Op, snapshot: dict, timing: bool, stream_name: str):
        self._dev = dev
        self._op = op
        self._snapshot = snapshot
        self.timing = timing
        self.stream_name = stream_name

    def __repr__(self) -> str:
        return f"<SimEvent on {self.stream_name} {'done' if self._op.done else 'pending'}>"

    def _observed(self) -> None:
        """The calling thread learned the event completed: it is now ordered after it."""
        self._dev._checker_merge(self._snapshot)

    @property
    def is_done(self) -> bool:
        with self._dev._lock:
            # a query is a host call and costs its overhead, so a polling loop lets virtual time move
            self._dev._host_api(self._dev.profile.event_overhead_s)
            if self._op.done:
                self._observed()
                return True
            return False

    def sync(self) -> None:
        with self._dev._lock:
            self._dev._block_until(lambda: self._op.done, what=repr(self))
            self._observed()
        if self._op.error is not None:
            raise self._op.error

    @property
    def error(self) -> BaseException | None:
        return self._op.error if self._op.done else None

    @property
    def owner(self) -> "SimDevice":
        return self._dev

    @property
    def done_at(self) -> float | None:
        """Virtual time the event completed (None while pending)."""
        return self._op.done_at

    def elapsed_since(self, earlier: Event) -> float:
        if not (self.timing and getattr(earlier, "timing", False)):
            raise RuntimeError("elapsed_since needs two events recorded with timing=True")
        if not isinstance(earlier, SimEvent) or earlier._op.done_at is None or self._op.done_at is None:
            raise RuntimeError("elapsed_since needs both events done; sync them first")
        return self._op.done_at - earlier._op.done_at


class SimStream(Stream):
    def __init__(self, dev: "SimDevice", priority: int = 0):
        self._dev = dev
        self.priority = priority
        self.id = next(_ids)
        self.name = f"stream {self.id}"
        self.actor = ("stream", self.id)
        self._queue = dev._engine.add_queue(self.name)
        self._queue.priority = priority
        # A failed launch's error goes to the next event recorded on this stream, and its words
        # to the next sync of the stream itself, which waits past it whichever event reported it
        # (words only: the error's traceback would keep a failed chunk's frames until that sync,
        # which a pipeline's compute stream may never have).
        self._pending_error: BaseException | None = None
        self._unsynced_error: str | None = None
        self._closed = False
        dev._checker.add_actor(self.actor, self.name)

    @property
    def owner(self) -> "SimDevice":
        return self._dev

    def __repr__(self) -> str:
        return f"<SimStream {self.id} priority={self.priority}{' closed' if self._closed else ''}>"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed; create a new stream")

    def _begin(self, overhead: float) -> None:
        """Start a host call that enqueues on this stream. The enqueued op runs after the call,
        so it is ordered after everything the calling thread did (and saw) before it."""
        self._check_open()
        self._dev._host_api(overhead)
        self._dev._checker.merge(self.actor, self._dev._checker.snapshot(self._dev._actor()))

    def _own(self, sl: BufferSlice) -> BufferSlice:
        """Refuse a buffer of another device (its checker has never heard of this stream)."""
        if getattr(sl.buffer, "_dev", None) is not self._dev:
            raise ValueError(f"{sl.buffer!r} belongs to another device; a stream can only use buffers "
                             "allocated on its own device (allocate them with this stream's device)")
        return sl

    def _enqueue(self, label: str, **kw) -> Op:
        op = Op(self._queue, label, **kw)
        return self._dev._engine.enqueue(op)

    def _capture(self) -> "SimCapture | None":
        """The capture this stream is part of, if any (the device's lock is held)."""
        return self._dev._captures.get(self)

    # -- ordering ----------------------------------------------------------------------
    def record(self, *, timing: bool = False) -> SimEvent:
        with self._dev._lock:
            capture = self._capture()
            if capture is not None:
                self._check_open()
                return capture.record(self, timing)
            self._begin(self._dev.profile.event_overhead_s)
            self._dev._checker.tick(self.actor)
            snapshot = self._dev._checker.snapshot(self.actor)

            def take_error(op: Op) -> None:
                op.error, self._pending_error = self._pending_error, None

            op = self._enqueue("event record", on_complete=take_error)
            return self._dev._new_event(op, snapshot, timing, self.name)

    def wait(self, event: "Event | SimHostWork") -> None:
        if isinstance(event, SimHostWork):
            self._wait_host_work(event)
            return
        if isinstance(event, CapturedEvent):
            # (checked outside the device's lock: its message takes the lock of the named devices)
            check_event_device(self, event, event.capture.dev)
            with self._dev._lock:
                self._check_open()
                self._wait_captured(event)
            return
        if not isinstance(event, SimEvent):
            raise TypeError(f"a sim stream can only wait on a SimEvent, got {type(event).__name__}")
        check_event_device(self, event, event._dev)
        with self._dev._lock:
            capture = self._capture()
            if capture is not None:
                raise capture.abandon(f"{self.name} waited for {event!r}, recorded outside the capture")
            self._begin(self._dev.profile.event_overhead_s)
            self._dev._checker.merge(self.actor, event._snapshot)
            if not event._op.done:
                self._enqueue("wait", deps=[event._op])

    def _wait_host_work(self, work: SimHostWork) -> None:
        """Later work on this stream starts once the submitter's host work ``work`` is done
        (:meth:`SimWorkerPool.host_work <.pool.SimWorkerPool.host_work>`). It stands for time the
        submitting thread spends before it enqueues that work, not for a device call: the host is
        charged nothing for it, and the checker gains no order (the work touches no memory)."""
        if work.dev is not self._dev:
            raise ValueError(f"{self.name} was given host work of another device; a stream can only wait for "
                             "host work of its own device's worker pools")
        with self._dev._lock:
            capture = self._capture()
            if capture is not None:
                raise capture.abandon(f"{self.name} waited for host work outside the capture")
            self._check_open()
            self._dev._host_api()  # (a broken context refuses it, as any call; it costs nothing)
            if not work.op.done:
                self._enqueue("wait for host work", deps=[work.op])

    def _wait_captured(self, event: CapturedEvent) -> None:
        """Wait for an event recorded during a capture: joins this stream to that capture."""
        capture = event.capture
        if capture.ended:
            raise event._refuse("waiting for")
        mine = self._capture()
        if mine is not None and mine is not capture:
            mine.abandon(f"{self.name} waited for an event of another capture")
            raise capture.abandon(f"{self.name}, capturing into another graph, waited for {event!r}")
        if mine is None:
            self._dev._captures[self] = capture
        capture.wait(self, event)

    # -- work ----------------------------------------------------------------------------
    def copy(self, dst, src, nbytes: int | None = None) -> None:
        with self._dev._lock:
            d, s = copy_extent(dst, src, nbytes)
            self._own(d), self._own(s)
            capture = self._capture()
            if capture is not None:
                self._check_open()
                capture.add(self, "copy", (dst, src, nbytes), {})
                return
            self._begin(self._dev.profile.copy_overhead_s)
            direction = {(True, False): "h2d", (False, True): "d2h"}.get((s.buffer.is_host, d.buffer.is_host))
            op_name = f"copy {direction or ('h2h' if d.buffer.is_host else 'd2d')} {d.nbytes} B"
            s.buffer._access(AccessKind.READ, s.offset, s.offset + s.nbytes, op_name, actor=self.actor)
            d.buffer._access(AccessKind.WRITE, d.offset, d.offset + d.nbytes, op_name, actor=self.actor, tick=False)
            src_mem, dst_mem = s.buffer._mem, d.buffer._mem

            def move(op: Op) -> None:
                dst_mem[d.offset:d.offset + d.nbytes] = src_mem[s.offset:s.offset + s.nbytes]

            self._enqueue(op_name, resource=direction or "d2d", nbytes=d.nbytes, direction=direction,
                          on_complete=self._guard(move))

    def fill(self, dst, byte: int) -> None:
        with self._dev._lock:
            d = self._own(as_slice(dst))
            if not 0 <= int(byte) <= 255:
                raise ValueError(f"fill byte must be in 0..255, got {byte}")
            capture = self._capture()
            if capture is not None:
                self._check_open()
                capture.add(self, "fill", (dst, byte), {})
                return
            self._begin(self._dev.profile.copy_overhead_s)
            op_name = f"fill 0x{int(byte):02x} {d.nbytes} B"
            d.buffer._access(AccessKind.WRITE, d.offset, d.offset + d.nbytes, op_name, actor=self.actor)
            mem = d.buffer._mem

            def memset(op: Op) -> None:
                mem[d.offset:d.offset + d.nbytes] = int(byte)

            self._enqueue(op_name, resource="d2d", nbytes=d.nbytes, on_complete=self._guard(memset))

    def launch(self, fn: Callable[..., Any], *args: Any, reads: Iterable[Any] = (), writes: Iterable[Any] = (),
               sim_seconds: float | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"launch needs a callable, got {type(fn).__name__}")
        if sim_seconds is not None:
            sim_seconds = check_seconds(sim_seconds, "launch sim_seconds")
        with self._dev._lock:
            capture = self._capture()
            if capture is None:
                self._launch_now(fn, args, reads, writes, sim_seconds)
                return
            self._check_open()
            reads, writes = tuple(reads), tuple(writes)
            read_only = self._access_sets(args, reads, writes)[2]
        self._capture_launch(capture, fn, args, read_only, {"reads": reads, "writes": writes,
                                                            "sim_seconds": sim_seconds})

    def _capture_launch(self, capture: SimCapture, fn: Callable[..., Any], args: tuple, read_only: list,
                        kwargs: dict) -> None:
        """A launch while capturing, as on a GPU: ``fn`` is called now, on this thread (without
        the device's lock), and what it does to its arrays is recorded (:mod:`.tape`); the
        graph's launches replay that, and never call ``fn``. ``fn`` reading device data on the
        host, or making a new device array and returning, abandons the capture; any other
        exception from it is raised here, the work it recorded before raising staying captured."""
        tape = Tape(getattr(fn, "__name__", type(fn).__name__), len(args), capture.shadows)
        try:
            tape.capture(fn, args, read_only)
        except HostRead:
            pass  # the capture is abandoned below (also where fn caught the error itself)
        finally:
            if tape.refused is None:  # (the launch stays a kernel of its sim_seconds over its arrays)
                with self._dev._lock:
                    capture.add(self, "launch", (tape, *args), kwargs)
        if tape.refused is not None:
            with self._dev._lock:
                raise capture.abandon(tape.refused)

    def _access_sets(self, args: tuple, reads: Iterable[Any], writes: Iterable[Any]) -> tuple[list, list, list]:
        """A launch's ``(read_set, write_set, read_only)``: the slices it reads and writes (an
        array argument named in neither counts as both), and for each argument whether ``fn``
        gets it read-only (an array named only in ``reads``).

        Raises:
            ValueError: a buffer of another device, or host memory, among the arguments.
            TypeError: a buffer passed as an argument instead of a typed array.
        """
        read_set = [self._own(as_slice(r)) for r in reads]
        write_set = [self._own(as_slice(w)) for w in writes]
        named = {(x.buffer, x.offset, x.nbytes) for x in read_set + write_set}
        for a in args:
            if isinstance(a, ArrayArg):
                self._own(as_slice(a))
                if a.where.buffer.is_host:
                    raise ValueError("launch takes device memory; copy host data to a device buffer first")
                if (a.where.buffer, a.where.offset, a.where.nbytes) not in named:
                    read_set.append(a.where)
                    write_set.append(a.where)
            elif isinstance(a, (Buffer, BufferSlice)):
                raise TypeError("pass buffers to launch as typed arrays: buf.array(dtype, shape)")
        # an array named only in reads= is handed to fn read-only, so an undeclared write fails
        # loudly (a LaunchError) instead of slipping past the checker
        # (an array of no bytes can take no write: it stays writable, as on a GPU)
        read_only = [isinstance(a, ArrayArg) and a.where.nbytes > 0 and not any(_overlap(a.where, w) for w in write_set)
                     for a in args]
        return read_set, write_set, read_only

    def _launch_now(self, fn: Callable[..., Any], args: tuple, reads: Iterable[Any], writes: Iterable[Any],
                    sim_seconds: float | None) -> None:
        """Enqueue ``fn(*args)`` to run when the launch completes in virtual time (the device's
        lock is held)."""
        self._begin(self._dev.profile.launch_overhead_s)
        read_set, write_set, read_only = self._access_sets(args, reads, writes)
        name = getattr(fn, "__name__", type(fn).__name__)
        op_name = f"launch {name}"
        self._dev._checker.tick(self.actor)
        touched = 0
        for sl in read_set:
            sl.buffer._access(AccessKind.READ, sl.offset, sl.offset + sl.nbytes, op_name, actor=self.actor, tick=False)
            touched += sl.nbytes
        for sl in write_set:
            sl.buffer._access(AccessKind.WRITE, sl.offset, sl.offset + sl.nbytes, op_name, actor=self.actor, tick=False)
            touched += sl.nbytes
        p = self._dev.profile
        seconds = sim_seconds if sim_seconds is not None else p.kernel_seconds(touched)

        def run(op: Op) -> None:
            nonlocal args
            arrays = [_materialise(a, ro) for a, ro in zip(args, read_only)]
            # a failure's traceback keeps this function (its frame's), and so what it closes
            # over: the op runs once, so the arguments' buffers need not stay reachable here
            args = ()
            try:
                fn(*arrays)
            except BaseException as exc:  # noqa: BLE001 - reported through the next event, Ctrl-C included
                err = LaunchError(f"{op_name} on {self.name} failed: {describe(exc)}")
                err.__cause__ = exc
                self._report(err)
                # this frame is in exc's traceback: a local keeping err (caused by exc) would
                # make a cycle, and keep this frame's callers (the host call that advanced
                # virtual time, with its chunks and events) until the cyclic collector runs
                del err

        self._enqueue(op_name, resource="compute", seconds=seconds, on_complete=self._guard(run))

    def _guard(self, effect: Callable[[Op], None]) -> Callable[[Op], None]:
        """Skip an op's effect once the device has a sticky error (the context is dead)."""
        def guarded(op: Op) -> None:
            if self._dev._sticky is None:
                effect(op)
        return guarded

    def _report(self, err: BaseException) -> None:
        """A launch on this stream failed (the device's lock is held, by the engine)."""
        self._pending_error = self._pending_error or err
        self._unsynced_error = self._unsynced_error or str(err)

    def sync(self) -> None:
        """Block until all work enqueued on this stream is done; raises the first launch error
        on it since its last sync, even where an event recorded after the launch reported it."""
        with self._dev._lock:
            capture = self._capture()
            if capture is not None:
                raise capture.abandon(f"synchronising {self.name}, which is capturing")
            # a stream that is not capturing, from the thread whose capture is in progress: a GPU
            # refuses that too (thread-local capture), where another thread may
            capture = capturing_thread(self._dev)
            if capture is not None:
                raise capture.abandon(f"synchronising {self.name} while {capture.origin.name} captures on this thread; "
                                      f"{SYNC_IN_CAPTURE}")
        try:
            self.record().sync()
        finally:
            with self._dev._lock:
                reported, self._unsynced_error = self._unsynced_error, None
        if reported is not None:
            raise LaunchError(f"{reported} (reported first by an event recorded after it)")

    # -- graphs ----------------------------------------------------------------------------
    def begin_capture(self) -> None:
        with self._dev._lock:
            self._check_open()
            self._dev._check_usable()
            if self._capture() is not None:
                raise CaptureError(f"{self.name} is capturing already; end that capture first")
            self._dev._captures[self] = SimCapture(self._dev, self)

    def end_capture(self) -> SimGraph:
        with self._dev._lock:
            capture = self._capture()
            if capture is None or capture.origin is not self:
                raise CaptureError(f"no capture was begun on {self.name}")
            self._finish(capture)
            if capture.reason is None:
                left = capture.unjoined()
                if left:
                    capture.abandon(f"{', '.join(s.name for s in left)} joined the capture and was not joined back: "
                                    f"make {self.name} wait for an event recorded there after its last work")
            if capture.reason is not None:
                raise CaptureError(f"capture abandoned: {capture.reason}")
            return SimGraph(self._dev, capture)

    def abort_capture(self) -> None:
        with self._dev._lock:
            capture = self._capture()
            if capture is not None and capture.origin is self:
                self._finish(capture)

    def _finish(self, capture: SimCapture) -> None:
        capture.ended = True
        capture.shadows.clear()  # the captured launches' shadow memory (tape.py)
        # every stream mapped to the capture, not only its lanes: a join stopped between the
        # two (an interrupt in capture.wait) would leave its stream capturing for good
        for stream in [s for s, c in self._dev._captures.items() if c is capture]:
            del self._dev._captures[stream]

    def _pass_on_errors(self, events: list) -> None:
        """After a graph's lanes: the first error any of its ``events`` reported goes to this
        stream's next event, as a failed launch on this stream would."""
        def take(op: Op) -> None:
            for end in events:
                if end._op.error is not None:
                    self._report(end._op.error)
                    return

        with self._dev._lock:
            self._begin(0.0)
            self._enqueue("graph end", on_complete=take)

    def close(self) -> None:
        if self._closed:
            return
        with self._dev._lock:
            self._closed = True
            self._pending_error = self._unsynced_error = None
            self._dev._release("streams", self.id)


def _overlap(a: BufferSlice, b: BufferSlice) -> bool:
    return a.buffer is b.buffer and a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes


def _materialise(a: Any, read_only: bool = False) -> Any:
    if isinstance(a, ArrayArg):
        mem = a.where.buffer._mem
        out = mem[a.where.offset:a.where.offset + a.where.nbytes].view(a.dtype).reshape(a.shape)
        if read_only:
            out.flags.writeable = False
        return out
    return a
