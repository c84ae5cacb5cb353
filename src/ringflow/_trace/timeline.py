"""Spans on one clock: every chunk's five stages, and the stalls between them.

CPU spans come from the host clock (``Device.now``). GPU spans come from timing events
placed on one device clock and aligned to the host clock by an **anchor**: a timing event the
scheduler records and syncs at start-up, noting the host time right after. A GPU time is
``anchor_host + event.elapsed_since(anchor)``. On the simulated GPU both clocks are the
virtual clock and the alignment is exact; on a real one it is off by the sync latency (a few
microseconds, the same for every span, so durations and overlaps are exact).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .._device.protocol import HostTask

STAGES = ("prepare", "h2d", "compute", "d2h", "consume")
GPU_STAGES = ("h2d", "compute", "d2h")

# Stalls: a chunk eligible for a stage but waiting for a free slot of the ring it needs.
SLOT_WAITS = (
    ("prepare", "wait host-in slot", "accepted", "prepare"),
    ("h2d", "wait device-in slot", "prepare.end", "h2d.enqueued"),
    ("compute", "wait device-out slot", "h2d.enqueued", "compute.enqueued"),
    ("d2h", "wait host-out slot", "compute.enqueued", "d2h.enqueued"),
)


@dataclasses.dataclass(frozen=True)
class Span:
    track: str
    name: str
    start: float  # seconds on the host clock
    end: float
    chunk: Optional[int] = None
    args: dict = dataclasses.field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclasses.dataclass
class ChunkRecord:
    index: int
    nbytes: int
    final: str
    accepted: float
    ended: float
    stages: dict  # stage -> (start, end)
    # the host stages that ran on the worker pool; the others ran inline on the scheduler's thread
    pooled: tuple = ("prepare", "consume")
    # (start, end) of the scheduler's host work for this chunk, which its last pool task (or, with
    # none, its copy in) came after (WorkerPool.host_work: the simulated GPU's model of its time
    # per chunk), or None
    scheduler: Optional[tuple] = None

    @property
    def latency(self) -> float:
        return self.ended - self.accepted


class Anchor:
    """Maps timing events onto the host clock (see the module doc)."""

    def __init__(self, device, stream):
        # what a pair of timing events adds to the span between them: taken off every GPU span
        self.floor = device.timing_floor(stream)
        self.event = stream.record(timing=True)
        self.event.sync()
        self.host = device.now

    def time_of(self, event) -> Optional[float]:
        if event is None or not event.is_done:
            return None
        return self.host + event.elapsed_since(self.event)

    def span_of(self, events: dict, stage: str) -> Optional[tuple[float, float]]:
        """``stage``'s span on the host clock from its ``.start`` and ``.end`` timing events, or
        None when either is missing or pending. The span starts no earlier than ``.enqueued``
        (the host time by which the operation had been enqueued) where that is known: when the
        host is the bottleneck the stream reaches the start event and then waits for the
        operation, and that wait is the host's time, not the stage's. The events' own time
        (:meth:`~ringflow._device.protocol.Device.timing_floor`) comes off its end. Since the
        operation may have started a little before the host noted the time, a span can come
        out a little short, never long: the ideal bound built from spans stays a bound."""
        start, end = self.time_of(events.get(stage + ".start")), self.time_of(events.get(stage + ".end"))
        if start is None or end is None:
            return None
        enqueued = events.get(stage + ".enqueued")
        if enqueued is not None:
            start = min(end, max(start, enqueued))
        return start, max(start, end - self.floor)


def record_chunk(chunk, anchor: Optional[Anchor]) -> ChunkRecord:
    """Turn a finished chunk's stamps, host-task spans and timing events into a record."""
    st = chunk.stamps
    stages: dict[str, tuple[float, float]] = {}
    pooled = []
    for stage, task in (("prepare", chunk.prepare_task), ("consume", chunk.consume_task)):
        if isinstance(task, HostTask):
            pooled.append(stage)
        span = getattr(task, "span", None) if task is not None else None
        if span is not None and span[1] is not None:
            stages[stage] = tuple(span)
        elif stage in st and st[stage][1] is not None:
            stages[stage] = tuple(st[stage])
    if anchor is not None:
        for stage in GPU_STAGES:
            span = anchor.span_of(chunk.events, stage)
            if span is not None:
                stages[stage] = span
    return ChunkRecord(index=chunk.index, nbytes=chunk.nbytes, final=_final(chunk),
                       accepted=st.get("accepted", 0.0), ended=st.get("ended", 0.0), stages=stages,
                       pooled=tuple(pooled), scheduler=getattr(chunk.host_work, "span", None))


def _final(chunk) -> str:
    """How ``chunk`` ended, as a report counts it: a chunk that small items shared goes on when
    an item fails or is cancelled, so it ends delivered even where none of its items was; it
    then counts as failed (any failed) or cancelled, as its items do."""
    final = chunk.state.value
    members = chunk.members
    if final != "delivered" or not members:
        return final
    if all(m.error is not None or m.future.done() for m in members):  # (a done future: cancelled by its caller)
        return "failed" if any(m.error is not None for m in members) else "cancelled"
    return final


def stall_spans(chunk_stamps: dict, index: int) -> list[Span]:
    out = []
    st = dict(chunk_stamps)
    if "prepare" in st:
        st["prepare.end"] = st["prepare"][1]
        st["prepare"] = st["prepare"][0]
    for _, name, a, b in SLOT_WAITS:
        if st.get(a) is not None and st.get(b) is not None and st[b] > st[a]:
            out.append(Span("stall: slots", name, st[a], st[b], index))
    return out


@dataclasses.dataclass
class Timeline:
    """Everything one profiled run produced, on the host clock."""

    records: list = dataclasses.field(default_factory=list)
    stalls: list = dataclasses.field(default_factory=list)  # Span
    meta: dict = dataclasses.field(default_factory=dict)
    host: list = dataclasses.field(default_factory=list)  # Span: CPU work that is no stage (enqueueing)

    def spans(self, *, lanes: bool = True) -> list[Span]:
        """Every span. With ``lanes`` overlapping spans of one track (CPU stages on several
        workers, stalls of several chunks) go to numbered sub-tracks, so none overlap."""
        out = self._raw_spans()
        return assign_lanes(out) if lanes else out

    def _raw_spans(self) -> list[Span]:
        out = []
        for r in self.records:
            for stage in STAGES:
                if stage in r.stages:
                    a, b = r.stages[stage]
                    out.append(Span(TRACKS[stage], stage, a, b, r.index, {"bytes": r.nbytes}))
            if r.scheduler is not None:
                out.append(Span(SCHEDULER_TRACK, "scheduler", *r.scheduler, r.index))
        return out + list(self.host) + list(self.stalls)

    @property
    def start(self) -> float:
        """Where the run's trace and chart count from: its first accepted chunk, or a stall or
        host span that began before it (a window of a long-lived pipeline can hold a caller's
        stall whose chunk ended in the previous window, or stalls and no chunk); 0.0 for nothing."""
        return min([r.accepted for r in self.records] + [s.start for s in self.stalls] + [s.start for s in self.host],
                   default=0.0)

    @property
    def end(self) -> float:
        return max((r.ended for r in self.records), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"records": [dataclasses.asdict(r) for r in self.records],
                "stalls": [dataclasses.asdict(s) for s in self.stalls],
                "host": [dataclasses.asdict(s) for s in self.host], "meta": self.meta}


TRACKS = {"prepare": "cpu: prepare", "h2d": "gpu: h2d stream", "compute": "gpu: compute stream",
          "d2h": "gpu: d2h stream", "consume": "cpu: consume"}
# the direct engine's host work: enqueueing a chunk's operations (it has no prepare or consume)
ENQUEUE_TRACK = "cpu: enqueue"
# the scheduler's host work for a chunk (ChunkRecord.scheduler)
SCHEDULER_TRACK = "cpu: scheduler"


def assign_lanes(spans: list[Span]) -> list[Span]:
    """Greedy interval partitioning per track: a span moves to ``"<track> [k]"`` for the first
    lane k whose last span ended before it starts (lane 0 keeps the plain track name)."""
    out: list[Span] = []
    lane_ends: dict[str, list[float]] = {}
    for s in sorted(spans, key=lambda s: (s.track, s.start, s.end)):
        ends = lane_ends.setdefault(s.track, [])
        for k, end in enumerate(ends):
            if end <= s.start:
                break
        else:
            k = len(ends)
            ends.append(0.0)
        ends[k] = s.end
        out.append(s if k == 0 else dataclasses.replace(s, track=f"{s.track} [{k}]"))
    return out


def track_sort_key(track: str):
    """Stage tracks in pipeline order (each with its lanes), then every other track by name."""
    base = track.split(" [")[0]
    lane = int(track.split(" [")[1].rstrip("]")) if " [" in track else 0
    order = [SCHEDULER_TRACK, TRACKS["prepare"], ENQUEUE_TRACK] + [TRACKS[s] for s in STAGES[1:]]
    return (order.index(base) if base in order else len(order), base, lane)
