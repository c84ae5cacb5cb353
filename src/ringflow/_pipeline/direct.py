"""The direct engine: a whole-array job enqueued in one pass, with no scheduler
(:class:`DirectSchedule`).

When the copy engines read ``x`` and write ``out`` where they lie (pinned or registered host
memory) and no stage runs on the CPU, a whole-array job is a sequence of stream operations
known before it starts: for chunk ``i``, copy its bytes in, compute, copy the result out. A
hand-written CUDA program enqueues that sequence in one loop and waits once; so does this.
The host then does a few microseconds of work per operation and none between chunks, so the
enqueueing runs far ahead of the GPU (docs/design.md, "Engines", has the measurements).

Ownership is carried by events, as in the scheduler: device slot ``k`` of a ring of ``K`` is
used by chunks ``k, k + K, ...``; a chunk's first operation on a slot waits on the event that
ended the slot's previous use (its copy out, or for a separate input ring its compute), so the
GPU hands each slot from one owner to the next without the host. With ``checked=True`` a
slot is poisoned after each use (ordered after it, and before the next), so a missing wait
shows up as a wrong result on a real GPU, as the scheduler's checked mode does.

``run()`` returns once every result is in ``out``: the host has then seen every operation of
the call complete, so it may rewrite ``x`` before the next call.

Small chunks move in copy groups (:class:`CopyGroup`): consecutive chunks in consecutive slots
share one copy each way, since every copy costs the copy engines a fixed time.

With ``graph=True`` and the arrays bound at construction (a ``MapJob``), the first call runs as
usual (a compute's first call may load its kernels or set up its library, which a capture
cannot take), and the next call that is not profiled captures the whole enqueue pass as one
CUDA graph (:meth:`~ringflow._device.protocol.Stream.begin_capture`: the same operations and
waits, the other streams joined from and back to the h2d stream) and launches it; every later
call is that one launch. The host then spends one launch per call instead of a dozen driver
calls per chunk. The compute is called while capturing, once per chunk, and by no launch: what
it read on the host is frozen at the capture (on the simulated GPU too, whose capture records
the compute's numpy work: ``_device/sim/tape.py``). A capture the device refuses (a compute
that synchronises, allocates or raises) leaves the job enqueueing as before, with the reason
logged once.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional, Sequence

from .. import _plan as plan
from .._device.protocol import BufferSlice, Device, close_quietly, free_quietly
from .._errors import LaunchError, StageError, describe
from .._testing import current as current_hooks
from .._trace.report import Report
from .._trace.timeline import ENQUEUE_TRACK, Anchor, ChunkRecord, Span, Timeline
from .config import SlotCounts, refuse_unknown_guards
from .engine import Arrays
from .frames import forget_callers, forget_own_frames
from .ring import allocate_ring
from .sigint import checkpoint
from .sizing import COMPUTE_BOUND_STREAMS, compute_streams_for, copy_group, is_compute_bound, taper
from .states import RingKind
from .stages import GPU_STAGES, StageStreams, is_interrupt, launch_compute, mark, poison_after, sim_seconds_for, writes_into_y

logger = logging.getLogger(__name__)

# The waits that order the job, named as the scheduler's guards for the same waits; a test can
# switch one off (``ringflow._testing.inject(guards_off=...)``) to show the checks catch it.
GUARDS = (
    "h2d.wait_slot_ready",  # a chunk's copy in waits for its device slot's previous use
    "compute.wait_h2d",  # compute waits for the chunk's copy in
    "compute.wait_slot_ready",  # compute waits for its device-out slot's previous use
    "d2h.wait_compute",  # the copy out waits for the chunk's compute
)


MEASURE_MIN_CHUNKS = 4  # a call of fewer chunks has no steady state to measure a chunk in


def _byte_ranges(layout) -> tuple[list, list]:
    """``(chunks, out_chunks)``: each chunk's ``(offset, nbytes, shape)`` in ``x`` and in the
    result, for a whole-array ``layout``."""
    row, out_row = layout.row_bytes, layout.out_row_bytes
    ranges = list(layout.ranges())
    return ([(a * row, (b - a) * row, (b - a,) + layout.tail) for a, b in ranges],
            [(a * out_row, (b - a) * out_row, (b - a,) + layout.out_tail) for a, b in ranges])


@dataclasses.dataclass(frozen=True)
class ChunkOps:
    """One chunk's operations, their arguments made once (a call only enqueues them)."""
    index: int
    offset: int  # of the chunk's bytes in x
    nbytes: int
    out_offset: int  # of the chunk's result in out
    out_nbytes: int
    slot_in: int  # device-in (or in-place) slot
    slot_out: int  # device-out slot; -1 in place
    dev_in: BufferSlice  # the chunk's bytes in its device-in slot
    dev_out: BufferSlice  # ... in its device-out slot (dev_in in place)
    x: Any  # dev_in as the compute's array argument
    y: Any  # dev_out as the compute's array argument (x in place)
    sim_seconds: Optional[float]


@dataclasses.dataclass(frozen=True)
class CopyGroup:
    """Consecutive chunks in consecutive device slots, moved by one copy in and one copy out
    (each chunk still computed on its own): the copy engines pay a fixed cost per copy, so
    small chunks are moved in groups (:func:`~ringflow._pipeline.sizing.copy_group`)."""
    ops: tuple  # the chunks' ChunkOps, in order
    offset: int  # of the group's bytes in x
    nbytes: int
    out_offset: int  # of its results in out
    out_nbytes: int
    host_in: Optional[BufferSlice]  # the group in x_buffer / out_buffer when bound at construction
    host_out: Optional[BufferSlice]
    dev_in: BufferSlice  # its device-in (or in-place) slots
    dev_out: BufferSlice  # its device-out slots (dev_in in place)


class DirectSchedule:
    """``compute(x, y)`` over ``chunks`` — ``(offset, nbytes, shape)`` byte ranges of ``x``'s
    pinned memory (of ``dtype``), results to the same ranges of ``out``'s — through device rings
    of ``slots.device_in`` (and ``slots.device_out``) slots of ``chunk_bytes``. A result shaped
    otherwise (``out_dtype``) has its own ``(offset, nbytes, shape)`` in ``out_chunks`` and
    device-out slots of ``out_chunk_bytes``. The arrays may be bound once here (their per-chunk
    slices are then made once) or given to each ``run``. ``copy_group`` consecutive chunks share
    one copy each way where the rings allow it (else one chunk per copy).

    Owns three streams (a fourth for poison fills when ``checked``) and the device rings;
    ``close()`` frees them, stream-ordered after everything enqueued, and never raises."""

    def __init__(self, device: Device, compute: Callable, chunks: Sequence[tuple[int, int, tuple]], dtype: Any, *,
                 chunk_bytes: int, slots: SlotCounts, inplace: bool, checked: bool = False,
                 bound: Optional[Arrays] = None, compute_streams: int = 1,
                 out_chunks: Optional[Sequence[tuple[int, int, tuple]]] = None, out_dtype: Any = None,
                 out_chunk_bytes: Optional[int] = None, graph: bool = False, copy_group: int = 1,
                 measure_compute: bool = False, tapered: Optional[Callable[[float], Optional[tuple]]] = None):
        if out_chunks is None:
            out_chunks, out_dtype, out_chunk_bytes = chunks, dtype, chunk_bytes
        if inplace and (list(out_chunks) != list(chunks) or out_dtype != dtype):
            raise ValueError("an in-place job's result is shaped as its input")
        self._guard_off = refuse_unknown_guards(current_hooks().guards_off, GUARDS)
        self.device = device
        self.compute = writes_into_y(compute)
        self.inplace = inplace
        self.checked = checked
        self.chunk_bytes = chunk_bytes
        self._rings: list = []
        n_in = min(slots.device_in, len(chunks))
        n_out = 0 if inplace else min(slots.device_out, len(chunks))
        # kernels of chunks in different device slots touch different memory, so each may run on
        # a stream of its own and overlap the others where the GPU has room; the waits on slot
        # events order every reuse whichever stream the previous owner ran on
        self.compute_streams = max(1, min(compute_streams, n_in))
        # measure_compute: the compute's cost is unknown; the first call times one chunk's kernel
        # against its copies and later calls get COMPUTE_BOUND_STREAMS if it is compute-bound
        self._measure_pending = bool(measure_compute) and len(chunks) >= MEASURE_MIN_CHUNKS
        self.measured_compute_bound: Optional[bool] = None
        self.streams = StageStreams(device, checked=checked,
                                    computes=max(self.compute_streams,
                                                 min(COMPUTE_BOUND_STREAMS, n_in) if self._measure_pending else 1))
        try:  # (a failure or Ctrl-C anywhere below frees the streams and whatever rings exist)
            self.dev_in = allocate_ring(device.allocate, RingKind.DEVICE_INPLACE if inplace else RingKind.DEVICE_IN,
                                        chunk_bytes, n_in)
            self._rings.append(self.dev_in)
            self.dev_out = None if inplace else allocate_ring(device.allocate, RingKind.DEVICE_OUT, out_chunk_bytes,
                                                              n_out)
            if self.dev_out is not None:
                self._rings.append(self.dev_out)
            # host time the last run spent enqueueing (its host overhead), on the device's clock: the
            # host's on a real GPU, virtual on the simulated one (whose host calls cost virtual time)
            self.enqueue_seconds = 0.0
            # graph=True on bound arrays: the captured call (None before the first, or when refused)
            self._graph_wanted = bool(graph) and bound is not None
            self._graph = None
            self._graph_computes: list = []  # the compute events recorded while capturing
            self.graph_refused: Optional[str] = None  # why calls are not replayed as a graph
            self.replayed = False  # whether the last run was a graph launch
            self._warmed = False  # whether a call has run to completion (the compute has been called)
            self._timeline: Optional[Timeline] = None  # the last profiled run's
            # the event each device slot's next owner waits on (its last use, or the poison fill after it)
            self._in_ready: list = [None] * n_in
            self._out_ready: list = [None] * n_out
            self._slots_seen_done = False  # whether the last call's sync saw every one of those events done
            self._bound = bound
            self._shapes = (dtype, out_dtype, out_chunk_bytes, n_in, n_out)
            # measure_compute: the chunks to run instead, as ``(chunks, out_chunks)`` of the measured
            # kernel's seconds, once the first call has found the job compute-bound (a taper: the rings
            # are the same)
            self._tapered = tapered if self._measure_pending else None
            self._lay_out(chunks, out_chunks, copy_group)
        except BaseException:
            self.close()
            raise

    def _lay_out(self, chunks: Sequence[tuple[int, int, tuple]], out_chunks: Sequence[tuple[int, int, tuple]],
                 copy_group: int) -> None:
        """Make each chunk's operations (:attr:`ops`) and the copy groups (:attr:`groups`) for
        ``chunks`` and ``out_chunks`` in this engine's device rings."""
        dtype, out_dtype, out_chunk_bytes, n_in, n_out = self._shapes
        chunk_bytes, inplace, bound = self.chunk_bytes, self.inplace, self._bound
        sim = getattr(self.compute, "sim_seconds", None)
        self._cost = sim  # held: a warm engine's key names a cost that is not a number by its id (cost_key)
        x_buffer = bound.x_buffer if bound is not None else None
        out_buffer = bound.out_buffer if bound is not None else None
        self.ops: list[ChunkOps] = []
        self._chunk_rows = [shape[0] for _, _, shape in chunks]
        for i, ((offset, nbytes, shape), (out_offset, out_nbytes, out_shape)) in enumerate(zip(chunks, out_chunks)):
            k_in, k_out = i % n_in, (-1 if inplace else i % n_out)
            dev_in = self.dev_in.slice(k_in * chunk_bytes, nbytes)
            dev_out = dev_in if inplace else self.dev_out.slice(k_out * out_chunk_bytes, out_nbytes)
            x = dev_in.array(dtype, shape)
            self.ops.append(ChunkOps(
                index=i, offset=offset, nbytes=nbytes, out_offset=out_offset, out_nbytes=out_nbytes,
                slot_in=k_in, slot_out=k_out, dev_in=dev_in, dev_out=dev_out, x=x,
                y=x if inplace else dev_out.array(out_dtype, out_shape), sim_seconds=sim_seconds_for(sim, nbytes)))
        # a group's slots must follow one another in each ring (no wrap inside a group), and its
        # chunks must be whole (back to back in x, out and the slots): only the last chunk is short
        g = max(1, int(copy_group))
        whole = all(op.nbytes == chunk_bytes and op.out_nbytes == out_chunk_bytes for op in self.ops[:-1])
        if not whole or any(0 < n < len(chunks) and n % g for n in (n_in, n_out)):
            g = 1
        self.copy_group = g
        self.groups: list[CopyGroup] = []
        for start in range(0, len(self.ops), g):
            ops = tuple(self.ops[start:start + g])
            first = ops[0]
            nbytes, out_nbytes = sum(op.nbytes for op in ops), sum(op.out_nbytes for op in ops)
            dev_in = self.dev_in.slice(first.slot_in * chunk_bytes, nbytes)
            self.groups.append(CopyGroup(
                ops=ops, offset=first.offset, nbytes=nbytes, out_offset=first.out_offset, out_nbytes=out_nbytes,
                host_in=x_buffer.slice(first.offset, nbytes) if x_buffer is not None else None,
                host_out=out_buffer.slice(first.out_offset, out_nbytes) if out_buffer is not None else None,
                dev_in=dev_in,
                dev_out=dev_in if inplace else self.dev_out.slice(first.slot_out * out_chunk_bytes, out_nbytes)))

    @classmethod
    def for_layout(cls, f: Callable, layout, options: dict, bound: Optional[Arrays] = None) -> "DirectSchedule":
        """The direct engine for a whole-array ``layout`` (its chunks, the planned device rings)."""
        inplace = bool(options.get("inplace", False))
        chunks, out_chunks = _byte_ranges(layout)
        # the device rings' slots are a chunk's input and its result's bytes (as allocated below)
        group, slots = copy_group(layout.device.hardware, layout.in_chunk_bytes, layout.n_chunks,
                                  layout.slots(f, options, external=True), planned=options.get("slots") is None,
                                  inplace=inplace, out_bytes=layout.out_chunk_bytes)
        measure = options.get("compute_streams") is None and group == 1 and layout.compute_bound is None

        def tapered(kernel_s: float) -> Optional[tuple]:
            """What a taper makes of the layout for a first call that finds the job compute-bound, a
            whole chunk's kernel taking ``kernel_s``; None where it cuts no chunk."""
            head = taper(layout.rows, max(layout.row_bytes, layout.out_row_bytes), kernel_s=kernel_s,
                         kernel_min_s=plan.get_profile(layout.device.hardware).kernel_min_s)
            ranges = _byte_ranges(dataclasses.replace(layout, taper=head)) if head else None
            return ranges if ranges != (chunks, out_chunks) else None

        return cls(layout.device, f, chunks, layout.dtype, chunk_bytes=layout.in_chunk_bytes,
                   slots=slots, inplace=inplace, copy_group=group,
                   checked=bool(options.get("checked", False)), bound=bound,
                   compute_streams=compute_streams_for(options.get("compute_streams"), group, layout.compute_bound),
                   measure_compute=measure, tapered=tapered if measure else None,
                   out_chunks=out_chunks,
                   out_dtype=layout.out_dtype, out_chunk_bytes=layout.out_chunk_bytes,
                   graph=bool(options.get("graph", False)))

    @property
    def closed(self) -> bool:
        return self.streams.closed

    def run(self, arrays: Optional[Arrays] = None, *, profile: bool = False) -> None:
        """Enqueue every chunk, then block until the last result is in ``out`` (the arrays bound
        at construction, or ``arrays``; a chunk's slices are then made as it is enqueued). With
        ``profile`` every operation is bracketed by timing events and the run's timeline kept for
        :meth:`report` (GPU spans aligned to the host clock, and each chunk's enqueueing on the
        host); without it no timing event is recorded.

        Raises:
            StageError: a compute failed (while being enqueued, or on the device).
            DeviceError: the device's sticky error.
            RuntimeError: the engine is closed.
            ValueError: no arrays bound and none given.
        Either way every operation already enqueued has completed before it raises, so nothing
        still reads or writes the caller's memory; ``out``'s contents are then unspecified. The
        error's traceback keeps the compute's own frames, but none of this engine's locals: a
        caller holding the error keeps neither the call's arrays nor this engine's buffers.
        """
        try:
            self._run(arrays, profile)
        except BaseException as exc:
            forget_own_frames(exc)  # the engine's frames below this one have returned
            # and this one stays in the traceback: it must not keep the engine or the arrays
            del self, arrays
            raise

    def _run(self, arrays: Optional[Arrays], profile: bool) -> None:
        """:meth:`run`'s call, raising as it says."""
        if self.closed:
            raise RuntimeError("this DirectSchedule is closed")
        self.replayed = False
        if arrays is None or arrays is self._bound:
            if self._bound is None:
                raise ValueError("no arrays were bound at construction; pass the call's arrays")
            if self._graph_wanted and not profile and self.graph_refused is None and self._warmed:
                self._run_graph()
                return

            def host(group):
                return group.host_in, group.host_out
        else:
            x_buffer, out_buffer = arrays.x_buffer, arrays.out_buffer

            def host(group):  # made as each group is enqueued, after the ones before it are on their way
                return (x_buffer.slice(group.offset, group.nbytes),
                        out_buffer.slice(group.out_offset, group.out_nbytes))
        self._timeline = None
        t0 = self.device.now
        measured = None
        seen_done = self._forget_done_slots()
        try:
            if profile:
                compute_events, stamps = self._enqueue_profiled(host)
            else:
                # the chunk measured (a whole one from the middle, the pipeline in its steady state)
                middle = len(self.groups) // 2 if self._measure_pending else -1
                compute_events = []
                for i, group in enumerate(self.groups):
                    checkpoint()  # a Ctrl-C stops the call between chunks (sigint.py)
                    events = [{} for _ in group.ops] if i == middle else None
                    compute_events.extend(self._enqueue(group, *host(group), events))
                    seen_done = None  # noqa: F841 - dropped once the first copy is on its way, not before it
                    if events is not None:
                        measured = events[0]
            self.enqueue_seconds = self.device.now - t0
            self.streams.d2h.record().sync()
        except BaseException:
            self.streams.settle()  # nothing enqueued may still touch the host memory when the caller sees this
            raise
        # every slot's last use precedes that sync (see _forget_done_slots), but the events are
        # dropped by the next call, after its first copy: here they would lengthen this call's tail
        self._slots_seen_done = self.streams.poison is None and not self._guard_off
        if profile:
            self._timeline = self._timeline_of(*stamps)
        failure = self._failure(compute_events)
        if failure is not None:
            # this frame is in the failure's traceback (and, on the simulated GPU, an ancestor of
            # the frames the compute ran in): the failed event, which holds the compute's
            # exception, must not stay in its locals (the events a profiled run stamped include
            # it), or the two would form a cycle
            compute_events = stamps = measured = None
            try:
                raise failure
            finally:
                del failure
        if measured is not None:
            self._plan_compute_streams(measured)
        self._warmed = True

    def _forget_done_slots(self) -> Optional[tuple]:
        """At the start of a call: forget the slots' events where the last call's sync saw them
        all done, so that this call's first pass through the rings waits for none (a wait costs a
        driver call, and the first one delays the call's first copy). Returns the lists forgotten
        (None: none), for the caller to drop once its first copy is enqueued.

        Every slot's last use is a copy out on the copy-out stream, or a compute that stream
        waited for before its copies out, so a call's last sync sees them all complete. A poison
        fill (checked mode) runs on a stream of its own and is kept, as are all of them while a
        guard is off (the checker's tests need the waits)."""
        if not self._slots_seen_done:
            return None
        self._slots_seen_done = False
        forgotten = self._in_ready, self._out_ready
        self._in_ready = [None] * len(self._in_ready)
        self._out_ready = [None] * len(self._out_ready)
        return forgotten

    @property
    def n_chunks(self) -> int:
        """The chunks a call runs (more once a measured compute-bound job is tapered)."""
        return len(self.ops)

    def chunk_rows(self, index: int) -> Optional[tuple[int, int]]:
        """The rows ``(start, stop)`` of ``x`` that chunk ``index`` of the last call held (its
        chunks as it ran them: tapered once a measured compute-bound job is), or None for an
        index the call did not have."""
        if not 0 <= index < len(self._chunk_rows):
            return None
        start = sum(self._chunk_rows[:index])
        return start, start + self._chunk_rows[index]

    def _plan_compute_streams(self, events: dict) -> None:
        """Plan later calls from the chunk timed by ``events`` (a call's timing events for one
        chunk): if it was compute-bound, COMPUTE_BOUND_STREAMS compute streams and the tapered
        chunks (when there are any), else one stream."""
        self._measure_pending = False

        def seconds(stage: str) -> float:
            return events[stage + ".end"].elapsed_since(events[stage + ".start"])

        kernel_s = seconds("compute")
        bound = is_compute_bound(kernel_s, seconds("h2d"), seconds("d2h"))
        self.measured_compute_bound = bound
        self.compute_streams = min(len(self.streams.computes), COMPUTE_BOUND_STREAMS) if bound else 1
        tapered = self._tapered(kernel_s) if bound and self._tapered is not None else None
        if tapered is not None:
            self._lay_out(*tapered, 1)
        self._tapered = None
        logger.debug("direct engine: the measured chunk was %scompute-bound; %d compute stream(s) from now on",
                     "" if bound else "not ", self.compute_streams)

    def _failure(self, compute_events: list) -> Optional[BaseException]:
        """What a call raises for the first chunk whose compute failed on the device, as its
        event (None: none kept) reports it, else None: a StageError whose cause is the
        callable's own exception, as the scheduler reports it, or a KeyboardInterrupt or
        SystemExit itself (as the scheduler raises it).

        On the simulated GPU a compute ran inside whichever host call advanced virtual time,
        and its exception's traceback keeps those calls' frames (``f_back``) and, with them, the
        events they held, its own failed event among them: :func:`forget_callers` clears the
        ones that have returned, for every failed chunk (not only the one raised), so no
        exception keeps the event that keeps it."""
        failure = None
        for op, event in zip(self.ops, compute_events):
            err = event.error if event is not None else None
            if err is None:
                continue
            cause = err.__cause__ or err
            forget_callers(cause)
            if failure is None:
                if isinstance(cause, Exception):
                    failure = StageError("compute", op.index, cause)
                    failure.__cause__ = cause
                else:
                    failure = cause
        return failure

    # -- graphs ----------------------------------------------------------------------------------
    def _run_graph(self) -> None:
        """One call as a launch of the captured graph (captured first if there is none yet; if
        the device refuses the capture, the call runs as an ordinary enqueue pass)."""
        origin = self.streams.h2d
        t0 = self.device.now
        # the graph's first use of each slot waits for nothing inside it: the launch itself
        # is ordered after every earlier use (an ordinary call's) here, on the launch stream
        joined = self._join_slots(origin)
        if self._graph is None and not self._capture(origin):
            self._in_ready = [joined] * len(self._in_ready)
            self._out_ready = [joined] * len(self._out_ready)
            self.run()
            return
        try:
            self._graph.launch(origin)
            done = origin.record()
            self.enqueue_seconds = self.device.now - t0
            try:
                done.sync()
            except LaunchError:  # a compute failed (reported through the graph's events)
                pass
        except BaseException:
            self.streams.settle()
            raise
        self.replayed = True
        failure = self._failure([self._graph.event(captured) for captured in self._graph_computes])
        if failure is not None:
            try:
                raise failure
            finally:
                del failure  # this frame is in its traceback: a local keeping it would make a cycle

    def _join_slots(self, origin):
        """Make ``origin`` wait for every slot's last use; returns an event after those waits
        (None when no slot has been used), and forgets the slots' events."""
        self._slots_seen_done = False  # (the lists are replaced below)
        pending = [e for e in self._in_ready + self._out_ready if e is not None]
        for event in dict.fromkeys(pending):
            origin.wait(event)
        self._in_ready = [None] * len(self._in_ready)
        self._out_ready = [None] * len(self._out_ready)
        return origin.record() if pending else None

    def _capture(self, origin) -> bool:
        """Capture one call's enqueue pass into ``self._graph``; returns False (the reason
        logged and kept in :attr:`graph_refused`) when the device refuses it."""
        st = self.streams
        # the streams a call uses: a compute stream made for a plan that measuring did not keep
        # takes no part, and joining it would wait on an event recorded outside the capture
        streams = [st.h2d, *st.computes[:self.compute_streams], st.d2h] + ([st.poison] if st.poison else [])
        try:
            # begun inside the try: an interrupt as it returns must abandon it too, or the device
            # goes on capturing for this thread (its every later allocation refused)
            origin.begin_capture()
            computes = [e for group in self.groups for e in self._enqueue(group, group.host_in, group.host_out)]
            for stream in streams:  # every stream that took part joins back into the origin
                if stream is not origin:
                    origin.wait(stream.record())
            self._graph = origin.end_capture()
            self._graph_computes = computes
        except Exception as exc:  # noqa: BLE001 - whatever the capture met, the call runs uncaptured
            origin.abort_capture()
            self.graph_refused = _reason(exc)  # no local keeps exc, whose traceback holds this frame
            logger.warning("MapJob(graph=True): the call could not be captured as a graph (%s); it runs "
                           "without one from now on", self.graph_refused)
            return False
        except BaseException:
            origin.abort_capture()
            raise
        finally:
            self._in_ready = [None] * len(self._in_ready)  # captured events mean nothing outside the graph
            self._out_ready = [None] * len(self._out_ready)
        return True

    def _enqueue(self, group: CopyGroup, host_in: BufferSlice, host_out: BufferSlice,
                 events: Optional[list] = None) -> list:
        """Enqueue a group's copy in, each of its chunks' computes, and its copy out; returns the
        computes' events. With ``events`` (profiling: a dict per chunk) each operation is
        bracketed by timing events, stored in its chunks' dicts (a group's copies in each)."""
        off = self._guard_off
        st = self.streams
        h2d, d2h = st.h2d, st.d2h
        copies: Optional[dict] = {} if events is not None else None
        if "h2d.wait_slot_ready" not in off:
            for ready in dict.fromkeys(self._in_ready[op.slot_in] for op in group.ops):
                if ready is not None:
                    h2d.wait(ready)
        mark(h2d, "h2d", copies, start=True)
        h2d.copy(group.dev_in, host_in, group.nbytes)
        copied_in = mark(h2d, "h2d", copies, device=self.device)
        computes = []
        for k, op in enumerate(group.ops):
            stamps = events[k] if events is not None else None
            comp = st.computes[op.index % self.compute_streams]
            if "compute.wait_h2d" not in off:
                comp.wait(copied_in)
            if not self.inplace:
                ready = self._out_ready[op.slot_out]
                if ready is not None and "compute.wait_slot_ready" not in off:
                    comp.wait(ready)
            mark(comp, "compute", stamps, start=True)
            try:
                launch_compute(comp, self.compute, op.x, op.y, inplace=self.inplace, sim_seconds=op.sim_seconds,
                               index=op.index)
            except StageError as err:
                if is_interrupt(err.__cause__):  # raised itself, as the scheduler's engine raises it
                    raise err.__cause__ from None
                raise
            computed = mark(comp, "compute", stamps, device=self.device)
            if not self.inplace:
                self._in_ready[op.slot_in] = self._after_use(op.dev_in, computed)
            if "d2h.wait_compute" not in off:
                d2h.wait(computed)
            computes.append(computed)
        mark(d2h, "d2h", copies, start=True)
        d2h.copy(host_out, group.dev_out, group.out_nbytes)
        copied_out = mark(d2h, "d2h", copies, device=self.device)
        after = self._after_use(group.dev_in if self.inplace else group.dev_out, copied_out)
        for op in group.ops:
            if self.inplace:
                self._in_ready[op.slot_in] = after
            else:
                self._out_ready[op.slot_out] = after
        if events is not None:  # each chunk is given its bytes' share of the group's copies
            done_in = done_out = 0
            for op, stamps in zip(group.ops, events):
                stamps.update(copies)
                stamps["h2d.share"] = (done_in / group.nbytes, (done_in + op.nbytes) / group.nbytes)
                stamps["d2h.share"] = (done_out / group.out_nbytes, (done_out + op.out_nbytes) / group.out_nbytes)
                done_in, done_out = done_in + op.nbytes, done_out + op.out_nbytes
        return computes

    def _enqueue_profiled(self, host: Callable) -> tuple[list, tuple]:
        """``run``'s enqueue pass with timing events and host stamps; returns the compute events
        and what :meth:`_timeline_of` needs once the run is done."""
        now = self.device.now
        anchor = Anchor(self.device, self.streams.h2d)  # seen done: every event recorded later times after it
        started = now
        chunk_events, enqueued, compute_events = [], [], []
        for group in self.groups:
            checkpoint()
            events: list = [{} for _ in group.ops]
            a = now
            compute_events.extend(self._enqueue(group, *host(group), events))
            chunk_events.extend(events)
            now = self.device.now
            enqueued.extend([(a, now)] + [None] * (len(group.ops) - 1))  # a group is enqueued at once
        return compute_events, (anchor, started, chunk_events, enqueued)

    def _timeline_of(self, anchor, started: float, chunk_events: list, enqueued: list) -> Timeline:
        """The finished profiled run on the host clock: every chunk accepted when the call
        started and delivered when its end was seen (now)."""
        ended = self.device.now
        timeline = Timeline(meta={"device": self.device.name, "chunk_bytes": self.chunk_bytes, "engine": "direct",
                                  "slots": {"device_in": len(self._in_ready), "device_out": len(self._out_ready)},
                                  "workers": 0, "compute_lanes": self._compute_lanes()})
        for op, events, host_span in zip(self.ops, chunk_events, enqueued):
            stages = {}
            for stage in GPU_STAGES:
                gpu_span = anchor.span_of(events, stage)
                if gpu_span is not None:
                    start, end = gpu_span
                    lo, hi = events.get(stage + ".share", (0.0, 1.0))
                    stages[stage] = (start + (end - start) * lo, start + (end - start) * hi)
            timeline.records.append(ChunkRecord(index=op.index, nbytes=op.nbytes, final="delivered",
                                                accepted=started, ended=ended, stages=stages))
            if host_span is not None:  # one for a group's first chunk: the group is enqueued at once
                timeline.host.append(Span(ENQUEUE_TRACK, "enqueue", *host_span, op.index))
        return timeline

    def _compute_lanes(self) -> int:
        """The compute resource's lanes for the ideal bound: its stream count. A kernel's timed span
        runs from its stream's start event to its end, so it may include waiting for another
        stream's kernel; but at most one span per stream is open at any moment, so the spans add
        up to at most the stream count times the wall time, whatever the GPU overlaps."""
        return self.compute_streams

    def report(self) -> Report:
        """The last profiled run's report (stage times, ideal bound, efficiency, ...). Chunks
        are all accepted when the call starts and delivered when it returns.

        Raises:
            RuntimeError: no call was profiled.
        """
        if self._timeline is None:
            raise RuntimeError("no profiled call to report; run with profile=True first")
        device_bytes = self.held_bytes()[1]
        memory = {"pinned allocated": 0, "pinned high-water": 0, "device allocated": device_bytes,
                  "device high-water": device_bytes}
        return Report.build(self._timeline, workers=1, memory=memory,
                            host_seconds=self.enqueue_seconds)

    def _after_use(self, where, last_use):
        """The event a slot's next owner waits on: ``last_use``, or in checked mode the poison
        fill ordered after it (a premature reuse then reads poison, not the old chunk)."""
        poison = self.streams.poison
        return last_use if poison is None else poison_after(poison, where, last_use)

    def fail(self, exc: BaseException) -> None:
        """After ``run`` raised ``exc``: settle and close; never raises."""
        self.streams.settle()
        self.close()

    def park(self) -> bool:
        """Forget the finished call; a schedule bound to arrays at construction is never kept
        (it holds their slices). Returns whether it can serve another call."""
        return not self.closed and self._bound is None

    def held_bytes(self) -> tuple[int, int]:
        """As :meth:`~ringflow._pipeline.engine.Engine.held_bytes`: the device rings (the host
        side is the caller's pinned memory)."""
        return 0, sum(ring.nbytes for ring in self._rings)

    def forget_forked(self) -> None:
        """As :meth:`~ringflow._pipeline.engine.Engine.forget_forked`: the graph, rings and
        streams are dropped unclosed (they are the parent's, and a close from here would free
        the parent's memory or fail)."""
        self._graph, self._rings = None, []
        self._in_ready = [None] * len(getattr(self, "_in_ready", ()))
        self._out_ready = [None] * len(getattr(self, "_out_ready", ()))
        self.streams.all = []

    def close(self) -> None:
        """Free the device rings (stream-ordered after all the job's work) and the streams.
        Harmless twice; never raises."""
        graph, self._graph = getattr(self, "_graph", None), None
        if graph is not None:
            self.streams.settle()  # its last launch must be done before it goes
            close_quietly(graph, "graph")
        rings, self._rings = self._rings, []
        self._in_ready = [None] * len(getattr(self, "_in_ready", ()))
        self._out_ready = [None] * len(getattr(self, "_out_ready", ()))
        free_on = self.streams.free_after() if rings else None
        for ring in rings:
            free_quietly(ring, free_on, "device ring")
        self.streams.close()


def _reason(exc: BaseException) -> str:
    """What a refused capture met: the compute's own error for a StageError, else ``exc``."""
    cause = exc.__cause__ if isinstance(exc, StageError) and exc.__cause__ is not None else exc
    return describe(cause)
