"""A whole-array job enqueued in one pass, with no scheduler: :class:`DirectSchedule`.

When the copy engines read ``x`` and write ``out`` where they lie (pinned or registered host
memory) and no stage runs on the CPU, a whole-array job is a sequence of stream operations
known before it starts: for chunk ``i``, copy its bytes in, compute, copy the result out. A
hand-written CUDA program enqueues that sequence in one loop and waits once; so does this.
The host then does a few microseconds of work per operation and none between chunks, so the
enqueueing runs far ahead of the GPU: on the H200 a warm 16-chunk call's first copy goes out 26 us
after the call (150-160 us with the CPU caches cold after a rewrite of ``x``) against 88-176 and
337-348 us through the scheduler's loop of events and slot states, and the call ends 0.17-0.28 ms
sooner (bench/results/phases-h200-2026-11-30-s4-*.json, bench-h200-2026-11-30-s4-mapjob-direct.json).

Ownership is carried by events, as in the pipeline: device slot ``k`` of a ring of ``K`` is
used by chunks ``k, k + K, ...``; a chunk's first operation on a slot waits on the event that
ended the slot's previous use (its copy out, or for a separate input ring its compute), so the
GPU hands each slot from one owner to the next without the host. With ``checked=True`` a
slot is poisoned after each use (ordered after it, and before the next), so a missing wait
shows up as a wrong result on a real GPU, as the pipeline's checked mode does.

``run()`` returns once every result is in ``out_buffer``: the host has then seen every
operation of the call complete, so it may rewrite ``x`` before the next call.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable, Optional, Sequence

from .._device.protocol import BufferSlice, Device, close_quietly, free_quietly, stream_after
from .._errors import DeviceError, StageError
from .._trace.report import Report
from .._trace.timeline import ENQUEUE_TRACK, GPU_STAGES, Anchor, ChunkRecord, Span, Timeline
from .config import SlotCounts, refuse_unknown_guards
from .scheduler import sim_seconds_for

# The waits that order the job, named as the pipeline's guards for the same waits; a test can
# switch one off (``disabled_guards``) to show the sim's checker catches its absence.
GUARDS = (
    "h2d.wait_slot_ready",  # a chunk's copy in waits for its device slot's previous use
    "compute.wait_h2d",  # compute waits for the chunk's copy in
    "compute.wait_slot_ready",  # compute waits for its device-out slot's previous use
    "d2h.wait_compute",  # the copy out waits for the chunk's compute
)
POISON_BYTE = 0xEE
# pipeline options that mean the same here, or nothing (there are no staging rings, workers or
# admission queue: a call is the whole array)
_OPTIONS = {"inplace", "slots", "checked", "workers", "pinned_budget", "max_in_flight", "ordered", "on_error",
            "profile", "_disabled_guards"}


ENGINES = ("auto", "direct", "pipeline")


def choose_engine(engine: str, strategy: str, options: dict) -> str:
    """"direct" or "pipeline" for a whole-array job: ``engine`` "auto" picks direct wherever it
    runs the job the same; "direct" where it cannot is a ValueError saying why."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    reason = why_not_direct(strategy, options)
    if engine == "direct" and reason is not None:
        raise ValueError(f"engine='direct' cannot run this job: {reason}; use engine='pipeline' (or 'auto')")
    return "direct" if engine != "pipeline" and reason is None else "pipeline"


def why_not_direct(strategy: str, options: dict) -> Optional[str]:
    """Why a whole-array job with this host strategy and these pipeline options needs the
    pipeline's scheduler, or None when the direct engine runs it the same."""
    if strategy == "stage":
        return "host='stage' copies x and out through pinned rings on CPU workers"
    if options.get("on_error", "raise") != "raise":
        return "on_error='continue' completes the other chunks around a failed one"
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        return f"the option(s) {unknown} are the pipeline's"
    guards = sorted(set(options.get("_disabled_guards", ())) - set(GUARDS))
    if guards:
        return f"the guard(s) {guards} are the pipeline's"
    return None


@dataclasses.dataclass(frozen=True)
class ChunkOps:
    """One chunk's operations, their arguments made once (a call only enqueues them)."""
    index: int
    offset: int  # of the chunk's bytes in x and out
    nbytes: int
    host_in: Optional[BufferSlice]  # the chunk in x_buffer / out_buffer when bound at construction
    host_out: Optional[BufferSlice]
    slot_in: int  # device-in (or in-place) slot
    slot_out: int  # device-out slot; -1 in place
    dev_in: BufferSlice  # the chunk's bytes in its device-in slot
    dev_out: BufferSlice  # ... in its device-out slot (dev_in in place)
    x: Any  # dev_in as the compute's array argument
    y: Any  # dev_out as the compute's array argument (x in place)
    sim_seconds: Optional[float]


class DirectSchedule:
    """``compute(x, y)`` over ``chunks`` — ``(offset, nbytes, shape)`` byte ranges of
    ``x_buffer``, results to the same ranges of ``out_buffer`` — through device rings of
    ``slots.device_in`` (and ``slots.device_out``) slots of ``slot_bytes``. The host buffers
    may be bound once here (their slices are then made once) or given to each ``run``.

    Owns three streams (a fourth for poison fills when ``checked``) and the device rings;
    ``close()`` frees them, stream-ordered after everything enqueued, and never raises."""

    def __init__(self, device: Device, compute: Callable, x_buffer, out_buffer,
                 chunks: Sequence[tuple[int, int, tuple]], dtype: Any, *, slot_bytes: int, slots: SlotCounts,
                 inplace: bool, checked: bool = False, disabled_guards: Iterable[str] = ()):
        guard_off = refuse_unknown_guards(disabled_guards, GUARDS)
        self.device = device
        self.compute = compute
        self.inplace = inplace
        self.checked = checked
        self._guard_off = guard_off
        self._streams: list = []
        self._rings: list = []
        try:
            self.h2d_stream, self.compute_stream, self.d2h_stream = (device.create_stream() for _ in range(3))
            self._streams += [self.h2d_stream, self.compute_stream, self.d2h_stream]
            self.poison_stream = device.create_stream() if checked else None
            if self.poison_stream is not None:
                self._streams.append(self.poison_stream)
            n_in = min(slots.device_in, len(chunks))
            n_out = 0 if inplace else min(slots.device_out, len(chunks))
            self.dev_in = device.allocate(slot_bytes * n_in)
            self._rings.append(self.dev_in)
            self.dev_out = None if inplace else device.allocate(slot_bytes * n_out)
            if self.dev_out is not None:
                self._rings.append(self.dev_out)
        except BaseException:
            self.close()
            raise
        self.slot_bytes = slot_bytes
        self.enqueue_seconds = 0.0  # host time the last run spent enqueueing (its host overhead)
        self._timeline: Optional[Timeline] = None  # the last profiled run's
        # the event each device slot's next owner waits on (its last use, or the poison fill after it)
        self._in_ready: list = [None] * n_in
        self._out_ready: list = [None] * n_out
        sim = getattr(compute, "sim_seconds", None)
        bound = x_buffer is not None
        self.ops: list[ChunkOps] = []
        for i, (offset, nbytes, shape) in enumerate(chunks):
            k_in, k_out = i % n_in, (-1 if inplace else i % n_out)
            dev_in = self.dev_in.slice(k_in * slot_bytes, nbytes)
            dev_out = dev_in if inplace else self.dev_out.slice(k_out * slot_bytes, nbytes)
            x = dev_in.array(dtype, shape)
            self.ops.append(ChunkOps(
                index=i, offset=offset, nbytes=nbytes, host_in=x_buffer.slice(offset, nbytes) if bound else None,
                host_out=out_buffer.slice(offset, nbytes) if bound else None, slot_in=k_in, slot_out=k_out, dev_in=dev_in,
                dev_out=dev_out, x=x, y=x if inplace else dev_out.array(dtype, shape),
                sim_seconds=sim_seconds_for(sim, nbytes)))

    @property
    def closed(self) -> bool:
        return not self._streams

    def run(self, x_buffer=None, out_buffer=None, *, profile: bool = False) -> None:
        """Enqueue every chunk, then block until the last result is in ``out_buffer`` (the
        buffers bound at construction, or these; a chunk's slices are made as it is enqueued).
        With ``profile`` every operation is bracketed by timing events and the run's timeline
        kept for :meth:`report` (GPU spans aligned to the host clock, and each chunk's enqueueing
        on the host); without it no timing event is recorded.

        Raises :class:`~ringflow._errors.StageError` for a compute that failed (while being
        enqueued, or on the device), or the device's sticky error; either way every operation
        already enqueued has completed before it returns or raises, so nothing still reads or
        writes the host buffers. ``out_buffer``'s contents are then unspecified."""
        if self.closed:
            raise RuntimeError("this DirectSchedule is closed")
        if (x_buffer is None) != (out_buffer is None):
            raise ValueError("pass both x_buffer and out_buffer, or neither (the ones bound at construction)")
        if x_buffer is None and self.ops and self.ops[0].host_in is None:
            raise ValueError("no host buffers were bound at construction; pass x_buffer and out_buffer")
        if x_buffer is None:
            def host(op):
                return op.host_in, op.host_out
        else:
            def host(op):  # made as each chunk is enqueued, after the ones before it are on their way
                return x_buffer.slice(op.offset, op.nbytes), out_buffer.slice(op.offset, op.nbytes)
        self._timeline = None
        t0 = time.perf_counter()
        try:
            if profile:
                compute_events, stamps = self._enqueue_profiled(host)
            else:
                compute_events = [self._enqueue(op, *host(op)) for op in self.ops]
            self.enqueue_seconds = time.perf_counter() - t0
            self.d2h_stream.record().sync()
        except BaseException:
            self.settle()  # nothing enqueued may still touch the host buffers when the caller sees this
            raise
        if profile:
            self._timeline = self._timeline_of(*stamps)
        for op, event in zip(self.ops, compute_events):
            err = event.error
            if err is not None:  # a launch that failed on the device (reported by its event)
                cause = err.__cause__ or err  # the callable's own exception, as the pipeline reports it
                raise StageError("compute", op.index, cause) from cause

    def _enqueue(self, op: ChunkOps, host_in: BufferSlice, host_out: BufferSlice, events: Optional[dict] = None):
        """Enqueue one chunk's copy in, compute and copy out; returns the compute's event. With
        ``events`` (profiling) each operation is bracketed by timing events, stored there."""
        off = self._guard_off
        timing = events is not None
        h2d, comp, d2h = self.h2d_stream, self.compute_stream, self.d2h_stream
        ready = self._in_ready[op.slot_in]
        if ready is not None and "h2d.wait_slot_ready" not in off:
            h2d.wait(ready)
        if timing:
            events["h2d.start"] = h2d.record(timing=True)
        h2d.copy(op.dev_in, host_in, op.nbytes)
        copied_in = h2d.record(timing=timing)
        if "compute.wait_h2d" not in off:
            comp.wait(copied_in)
        if not self.inplace:
            ready = self._out_ready[op.slot_out]
            if ready is not None and "compute.wait_slot_ready" not in off:
                comp.wait(ready)
        if timing:
            events["compute.start"] = comp.record(timing=True)
        try:
            if self.inplace:
                comp.launch(self.compute, op.x, op.x, writes=[op.x], sim_seconds=op.sim_seconds)
            else:
                comp.launch(self.compute, op.x, op.y, reads=[op.x], writes=[op.y], sim_seconds=op.sim_seconds)
        except DeviceError as err:
            if err.sticky:
                raise
            raise StageError("compute", op.index, err) from err
        except Exception as exc:  # noqa: BLE001 - the compute callable raised while it was enqueued
            raise StageError("compute", op.index, exc) from exc
        computed = comp.record(timing=timing)
        if not self.inplace:
            self._in_ready[op.slot_in] = self._after_use(op.dev_in, computed)
        if "d2h.wait_compute" not in off:
            d2h.wait(computed)
        if timing:
            events["d2h.start"] = d2h.record(timing=True)
        d2h.copy(host_out, op.dev_out, op.nbytes)
        copied_out = d2h.record(timing=timing)
        if timing:
            events.update({"h2d.end": copied_in, "compute.end": computed, "d2h.end": copied_out})
        if self.inplace:
            self._in_ready[op.slot_in] = self._after_use(op.dev_in, copied_out)
        else:
            self._out_ready[op.slot_out] = self._after_use(op.dev_out, copied_out)
        return computed

    def _enqueue_profiled(self, host: Callable) -> tuple[list, tuple]:
        """``run``'s enqueue pass with timing events and host stamps; returns the compute events
        and what :meth:`_timeline_of` needs once the run is done."""
        now = self.device.now
        anchor = Anchor(self.device, self.h2d_stream)  # seen done: every event recorded later times after it
        started = now
        chunk_events, enqueued, compute_events = [], [], []
        for op in self.ops:
            events: dict = {}
            a = now
            compute_events.append(self._enqueue(op, *host(op), events))
            chunk_events.append(events)
            now = self.device.now
            enqueued.append((a, now))
        return compute_events, (anchor, started, chunk_events, enqueued)

    def _timeline_of(self, anchor, started: float, chunk_events: list, enqueued: list) -> Timeline:
        """The finished profiled run on the host clock: every chunk accepted when the call
        started and delivered when its end was seen (now)."""
        ended = self.device.now
        timeline = Timeline(meta={"device": self.device.name, "chunk_bytes": self.slot_bytes, "engine": "direct",
                                  "slots": {"device_in": len(self._in_ready), "device_out": len(self._out_ready)},
                                  "workers": 0})
        for op, events, (a, b) in zip(self.ops, chunk_events, enqueued):
            stages = {}
            for stage in GPU_STAGES:
                start, end = anchor.time_of(events.get(stage + ".start")), anchor.time_of(events.get(stage + ".end"))
                if start is not None and end is not None:
                    stages[stage] = (start, end)
            timeline.records.append(ChunkRecord(index=op.index, nbytes=op.nbytes, final="delivered",
                                                accepted=started, ended=ended, stages=stages))
            timeline.host.append(Span(ENQUEUE_TRACK, "enqueue", a, b, op.index))
        return timeline

    def report(self) -> Report:
        """The last profiled run's report (stage times, ideal bound, efficiency, ...). Chunks
        are all accepted when the call starts and delivered when it returns."""
        if self._timeline is None:
            raise RuntimeError("no profiled run to report; call run(..., profile=True) first")
        device_bytes = sum(ring.nbytes for ring in self._rings)
        memory = {"pinned allocated": 0, "pinned high-water": 0, "device allocated": device_bytes,
                  "device high-water": device_bytes}
        return Report.build(self._timeline, workers=1, memory=memory,
                            host_seconds=self.enqueue_seconds)

    def _after_use(self, where, last_use):
        """The event a slot's next owner waits on: ``last_use``, or in checked mode the poison
        fill ordered after it (a premature reuse then reads poison, not the old chunk)."""
        if self.poison_stream is None:
            return last_use
        self.poison_stream.wait(last_use)
        self.poison_stream.fill(where, POISON_BYTE)
        return self.poison_stream.record()

    def fail(self, exc: BaseException) -> None:
        """After ``run`` raised ``exc``: settle and close; never raises."""
        self.settle()
        self.close()

    def settle(self) -> None:
        """Block until everything enqueued has completed; never raises (a broken device
        completes nothing more, and its error was or will be reported by ``run``)."""
        for s in self._streams:
            try:
                s.sync()
            except Exception:  # noqa: BLE001 - settling must not mask the error being handled
                pass

    def close(self) -> None:
        """Free the device rings (stream-ordered after all the job's work) and the streams.
        Harmless twice; never raises."""
        streams, self._streams = self._streams, []
        rings, self._rings = self._rings, []
        self._in_ready = [None] * len(getattr(self, "_in_ready", ()))
        self._out_ready = [None] * len(getattr(self, "_out_ready", ()))
        free_on = stream_after(streams)
        for ring in rings:
            free_quietly(ring, free_on, "device ring")
        for s in streams:
            close_quietly(s, "stream")
