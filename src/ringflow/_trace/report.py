"""The report of one profiled run: where the time went, against the ideal bound.

* **stage times**: per-chunk duration of each stage, median and spread (p10..p90);
* **ideal bound** (:func:`ideal_seconds`): a lower bound on the run's wall time from the
  stage times each chunk actually had, with every stage on its resource (the copy engines and
  the compute stream one chunk at a time, prepare and consume on the pool of CPU workers), so
  no schedule of the same work beats it; over identical chunks it is
  :func:`ringflow._plan.ideal_total`;
* **bottleneck**: the resource with the most work per chunk over its parallelism;
* **measured** time (first accepted chunk to last ended) and **efficiency** = ideal / measured,
  at most 1;
* request **latency** p50/p95/p99 (accepted to ended), **loaded throughput**;
* **stall** totals and pinned/device memory high-water marks; scheduler host time per chunk.

A report shows itself as one line (``repr``), a table (``str``, rich, ``_repr_html_`` in a
notebook) and a Gantt chart (:meth:`Report.plot`).
"""

from __future__ import annotations

import dataclasses
import html
import io
import math
from typing import Any, Optional, Sequence

import numpy as np

from .. import _jsontext as jsontext
from .chrome import save_chrome
from .timeline import GPU_STAGES, STAGES, ChunkRecord, Timeline

CPU_POOL = "cpu (prepare+consume)"
CPU_INLINE = "cpu inline (prepare+consume)"
SCHEDULER = "scheduler (host)"  # the scheduler's host work per chunk (ChunkRecord.scheduler), as the planner names it


def _pct(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def _duration(record: ChunkRecord, stage: str) -> float:
    span = record.stages.get(stage)
    return max(0.0, span[1] - span[0]) if span is not None else 0.0


def _resource(record: ChunkRecord, stage: str, workers: int, compute_lanes: int = 1) -> tuple[str, int]:
    """(resource, lanes) that ran ``stage`` of ``record``."""
    if stage == "compute":
        return stage, compute_lanes  # kernels on several streams may run side by side
    if stage in GPU_STAGES:
        return stage, 1  # one copy engine each way, one copy at a time
    return (CPU_POOL, workers) if stage in record.pooled else (CPU_INLINE, 1)


def _busy_on_lanes(durations: Sequence[float], lanes: int) -> float:
    """The least time ``lanes`` lanes need for these indivisible pieces of work: the work
    spread evenly, or the ``ceil(m / lanes)`` shortest pieces that some lane must take."""
    k = -(-len(durations) // lanes)
    return max(sum(durations) / lanes, sum(sorted(durations)[:k]))


def _resource_bound(pieces: list, lanes: int) -> float:
    """A lower bound on the wall time from a resource's ``pieces`` of work, each
    ``(duration, before, after)``: ``before`` the time its chunk spent in earlier stages,
    ``after`` the time it spends in later ones.

    Any subset of the pieces starts no sooner than its shortest ``before`` and ends no later
    than the run's end less its shortest ``after``, and its lanes need the subset's work in
    between. Checked over all pieces, and over those whose ``before`` (or ``after``) is at
    least each value in turn, so one short chunk (a short last one) does not hide the fill of
    all the others."""
    best = min(p[1] for p in pieces) + _busy_on_lanes([p[0] for p in pieces], lanes) + min(p[2] for p in pieces)
    for key, other in ((1, 2), (2, 1)):
        work, low = 0.0, math.inf
        for p in sorted(pieces, key=lambda p: p[key], reverse=True):
            work += p[0]
            low = min(low, p[other])
            best = max(best, p[key] + work / lanes + low)
    return best


def ideal_seconds(records: Sequence[ChunkRecord], workers: int, compute_lanes: int = 1) -> float:
    """A lower bound on the wall time (first accepted to last ended) of a run of these chunks.

    Each chunk passes its stages in order, each stage taking the time it took in the run. A
    resource runs the stages given to it on its lanes: the H2D stream, the compute stream and
    the D2H stream one chunk at a time; prepare and consume on the pool of ``workers`` CPU
    threads (``ChunkRecord.pooled``), or inline on the scheduler's one thread. Nothing starts on
    a resource before some chunk has spent the stages before it there, and after its last piece
    of work that chunk still spends the stages after it. The bound is the largest of:

    * the longest chunk's latency (the sum of its stage times);
    * for each stage of each resource: the shortest sum of the stages before it, plus the least
      time its lanes need for every chunk's piece of it (all pieces spread evenly over the lanes,
      or the ``ceil(n / lanes)`` shortest, which one lane must take), plus the shortest sum of
      the stages after it; and the same over the chunks whose stages before (or after) it take
      at least a given time, for each such time;
    * the same for a resource serving two stages (the CPU pool) over all its pieces: a prepare
      needs nothing before it and a consume nothing after, so this is its work over its lanes
      (or the ``ceil(2n / lanes)`` shortest pieces).

    Copies taken while the other direction ran shared the link, and their times say so. The
    scheduler's host work for a chunk (``ChunkRecord.scheduler``: the simulated GPU's model of its
    time per chunk) is a resource of one lane too, after the chunk was accepted and before
    those of its stages that start once it is done; the scheduler's other host time is not
    counted (it is no span).

    Args:
        records: the run's delivered chunks; a stage missing from a record takes no time.
        workers: threads of the CPU pool (values below 1 count as 1).
        compute_lanes: kernels that may run at once (one per compute stream on a GPU with
            concurrent kernels): the compute resource's lanes.

    Returns:
        seconds; 0.0 for no records.
    """
    if not records:
        return 0.0
    workers = max(1, int(workers))
    bound = 0.0
    pieces: dict[str, dict[str, list]] = {}  # resource -> stage -> [(duration, before, after)]
    lanes: dict[str, int] = {}
    for r in records:
        d = {s: _duration(r, s) for s in STAGES}
        latency = sum(d.values())
        bound = max(bound, latency)
        if r.scheduler is not None:  # the stages that waited for it follow it, one after another
            lanes[SCHEDULER] = 1
            after = sum(d[s] for s in STAGES if s in r.stages and r.stages[s][0] >= r.scheduler[1])
            pieces.setdefault(SCHEDULER, {}).setdefault("scheduler", []).append(
                (max(0.0, r.scheduler[1] - r.scheduler[0]), 0.0, after))
        before = 0.0
        for stage in STAGES:
            if stage in r.stages:
                res, n_lanes = _resource(r, stage, workers, compute_lanes)
                lanes[res] = n_lanes
                pieces.setdefault(res, {}).setdefault(stage, []).append((d[stage], before, latency - before - d[stage]))
            before += d[stage]
    for res, by_stage in pieces.items():
        for group in by_stage.values():
            bound = max(bound, _resource_bound(group, lanes[res]))
        if len(by_stage) > 1:
            bound = max(bound, _resource_bound([p for group in by_stage.values() for p in group], lanes[res]))
    return bound


def bottleneck_of(records: Sequence[ChunkRecord], workers: int, compute_lanes: int = 1) -> str:
    """The resource with the most work per chunk over its lanes ("none" for no records)."""
    if not records:
        return "none"
    workers = max(1, int(workers))
    load = {"h2d": 0.0, "compute": 0.0, "d2h": 0.0, CPU_POOL: 0.0}
    for r in records:
        if r.scheduler is not None:
            load[SCHEDULER] = load.get(SCHEDULER, 0.0) + max(0.0, r.scheduler[1] - r.scheduler[0])
        for stage in r.stages:
            if stage in STAGES:
                res, n_lanes = _resource(r, stage, workers, compute_lanes)
                load[res] = load.get(res, 0.0) + _duration(r, stage) / n_lanes
    return max(load, key=load.get)


@dataclasses.dataclass(repr=False)
class Report:
    """What a profiled run did: the figures below, its timeline (for :meth:`save_trace` and
    :meth:`plot`), and ``print(report)`` as a table. Times are in seconds (virtual on the
    simulated GPU); the figures cover the chunks that delivered.

    Attributes:
        timeline: every chunk's stage spans and the stalls, as recorded.
        chunks: chunks that delivered.
        bytes_in: bytes of input those chunks carried.
        measured_s: first accepted chunk to last ended, seconds.
        stage_median_s: per stage (``"prepare"``, ``"h2d"``, ``"compute"``, ``"d2h"``,
            ``"consume"``), a chunk's median duration, seconds (0.0 for a stage that did not run).
        stage_spread_s: per stage, the ``(p10, p90)`` of a chunk's duration, seconds.
        workers: CPU worker lanes the ideal bound counts.
        bottleneck: the resource with the most work per chunk over its lanes (``"h2d"``,
            ``"compute"``, ``"d2h"``, ``"cpu (prepare+consume)"``, ``"scheduler (host)"`` where the
            scheduler's host work per chunk was recorded; ``"none"`` without chunks).
        ideal_s: the ideal bound, seconds: the least time the chunks' own stage times allow.
        efficiency: ``ideal_s / measured_s`` (NaN when nothing was measured).
        latency_s: a chunk's accepted-to-ended time at ``"p50"``, ``"p95"`` and ``"p99"``, seconds.
        throughput_GBps: ``bytes_in / measured_s`` in GB/s (10^9 bytes a second).
        stall_s: per kind of stall (a producer blocked, a stage waiting for a slot, ...), the
            total seconds.
        memory: bytes of pinned and device memory allocated and their high-water marks
            (``"pinned allocated"``, ``"pinned high-water"``, ``"device allocated"``,
            ``"device high-water"``).
        host_overhead_per_chunk_s: the scheduler's (or the direct engine's enqueue) host time
            per chunk, seconds.
    """

    timeline: Timeline
    chunks: int
    bytes_in: int
    measured_s: float
    stage_median_s: dict
    stage_spread_s: dict  # stage -> (p10, p90)
    workers: int
    bottleneck: str
    ideal_s: float
    efficiency: float
    latency_s: dict  # p50/p95/p99
    throughput_GBps: float
    stall_s: dict
    memory: dict
    host_overhead_per_chunk_s: float

    @classmethod
    def build(cls, timeline: Timeline, *, workers: int, memory: dict, host_seconds: float) -> "Report":
        recs = [r for r in timeline.records if r.final == "delivered"]
        n = len(recs)
        med, spread = {}, {}
        for stage in STAGES:
            d = [_duration(r, stage) for r in recs if stage in r.stages]
            med[stage] = _pct(d, 50) if d else 0.0
            spread[stage] = (_pct(d, 10), _pct(d, 90)) if d else (0.0, 0.0)
        compute_lanes = int(timeline.meta.get("compute_lanes", 1))
        ideal = ideal_seconds(recs, workers, compute_lanes)
        measured = (max(r.ended for r in recs) - min(r.accepted for r in recs)) if recs else 0.0
        lat = [r.latency for r in recs]
        stalls: dict[str, float] = {}
        for s in timeline.stalls:
            stalls[s.name] = stalls.get(s.name, 0.0) + s.duration
        nbytes = sum(r.nbytes for r in recs)
        return cls(timeline=timeline, chunks=n, bytes_in=nbytes, measured_s=measured, stage_median_s=med,
                   stage_spread_s=spread, workers=workers, bottleneck=bottleneck_of(recs, workers, compute_lanes), ideal_s=ideal,
                   efficiency=(ideal / measured) if measured > 0 else float("nan"),
                   latency_s={"p50": _pct(lat, 50), "p95": _pct(lat, 95), "p99": _pct(lat, 99)},
                   throughput_GBps=(nbytes / measured / 1e9) if measured > 0 else 0.0, stall_s=stalls,
                   memory=memory, host_overhead_per_chunk_s=host_seconds / max(1, len(timeline.records)))

    # -- output ------------------------------------------------------------------------------------
    def save_trace(self, path: str) -> str:
        """Write the Chrome/Perfetto JSON of the run (open it in ui.perfetto.dev); returns ``path``.

        Raises:
            TypeError: ``path`` is not a file name (a str or os.PathLike).
            OSError: the file cannot be written, or is a device, pipe or socket.
        """
        return save_chrome(self.timeline, path)

    def plot(self, path: Optional[str] = None, *, ax: Any = None) -> Any:
        """A Gantt chart of the run: a row per stage track (CPU stages a row per worker lane), a
        bar per chunk, stalls in grey; times in ms since the first chunk was accepted.

        Uses no pyplot state and never changes matplotlib's backend, so notebooks keep their
        inline plots.

        Args:
            path: where to save the figure: a file name or an open binary file, its format
                from the name's extension (e.g. ``.png``, ``.svg``; PNG without one); None saves
                nothing.
            ax: a matplotlib ``Axes`` to draw into; None draws into a new ``Figure``.

        Returns:
            the ``matplotlib.figure.Figure`` drawn on (``ax``'s figure when given).

        Raises:
            RuntimeError: matplotlib is not installed.
            TypeError: ``ax`` is not a matplotlib Axes, or ``path`` is neither None, a file
                name nor an open file.
            ValueError: ``path``'s extension is a file type matplotlib cannot write, or
                ``.pgf`` without LaTeX installed (said before anything is drawn; the message lists
                the types it writes).
            OSError: the file cannot be written, or is a device, pipe or socket (a file name is
                written whole, as :meth:`save_trace` writes).
        """
        from .plot import plot_gantt

        return plot_gantt(self.timeline, path, ax=ax, title=self.headline())

    def headline(self) -> str:
        """One line: chunks, megabytes in, measured and ideal milliseconds, efficiency and the
        bottleneck stage."""
        return (f"{self.chunks} chunks, {self.bytes_in / 1e6:.1f} MB in {self.measured_s * 1e3:.3f} ms "
                f"(ideal {self.ideal_s * 1e3:.3f} ms, efficiency {self.efficiency:.2f}, bottleneck {self.bottleneck})")

    def as_dict(self) -> dict[str, Any]:
        """The report's fields as plain values for JSON, without the timeline's spans: a figure
        that does not exist (the efficiency and latencies of a run that delivered nothing, NaN
        on the report) is None, and the p10..p90 pairs are lists."""
        d = dataclasses.asdict(self)
        d.pop("timeline")
        return jsontext.plain(d)

    def table(self):
        """The report as a ``rich.table.Table``."""
        from rich.table import Table

        t = Table(title=self.headline(), show_lines=False)
        t.add_column("stage")
        t.add_column("median ms", justify="right")
        t.add_column("p10..p90 ms", justify="right")
        for stage in STAGES:
            lo, hi = self.stage_spread_s[stage]
            t.add_row(stage, f"{self.stage_median_s[stage] * 1e3:.4f}", f"{lo * 1e3:.4f}..{hi * 1e3:.4f}")
        t.add_section()
        t.add_row("latency p50/p95/p99", "/".join(f"{self.latency_s[k] * 1e3:.3f}" for k in ("p50", "p95", "p99")), "ms")
        t.add_row("loaded throughput", f"{self.throughput_GBps:.2f}", "GB/s in")
        for name, s in sorted(self.stall_s.items()):
            t.add_row(f"stall: {name}", f"{s * 1e3:.3f}", "ms total")
        for name, v in self.memory.items():
            t.add_row(name, f"{v / 2**20:.1f}", "MiB")
        t.add_row("scheduler host time", f"{self.host_overhead_per_chunk_s * 1e6:.1f}", "us per chunk")
        return t

    def __repr__(self) -> str:
        return (f"<Report {self.chunks} chunks in {self.measured_s * 1e3:.3f} ms, bottleneck {self.bottleneck}, "
                f"efficiency {self.efficiency:.2f}>")

    def __str__(self) -> str:
        # rich renders into memory: a console on a file of its own would leave the file open
        from rich.console import Console

        console = Console(width=100, record=True, file=io.StringIO())
        console.print(self.table())
        return console.export_text()

    def __rich__(self):
        return self.table()

    def _repr_html_(self) -> str:
        """A small HTML table for notebooks: stage times, bottleneck, ideal bound, efficiency,
        latency."""
        e = html.escape

        def ms(seconds: float, digits: int = 3) -> str:
            return "-" if math.isnan(seconds) else f"{seconds * 1e3:.{digits}f}"

        rows = [f"<tr><td>{e(stage)}</td><td>{ms(self.stage_median_s[stage], 4)}</td>"
                f"<td>{ms(self.stage_spread_s[stage][0], 4)}..{ms(self.stage_spread_s[stage][1], 4)}</td></tr>"
                for stage in STAGES]
        facts = [("bottleneck", e(self.bottleneck)), ("ideal bound", f"{ms(self.ideal_s)} ms"),
                 ("measured", f"{ms(self.measured_s)} ms"), ("efficiency", f"{self.efficiency:.2f}"),
                 ("latency p50", f"{ms(self.latency_s['p50'])} ms"), ("latency p99", f"{ms(self.latency_s['p99'])} ms"),
                 ("loaded throughput", f"{self.throughput_GBps:.2f} GB/s in")]
        rows += [f'<tr><th style="text-align:left">{name}</th><td colspan="2">{value}</td></tr>'
                 for name, value in facts]
        caption = e(f"{self.chunks} chunks, {self.bytes_in / 1e6:.1f} MB in {self.measured_s * 1e3:.3f} ms")
        return ('<table class="ringflow-report">'
                f"<caption>{caption}</caption>"
                "<thead><tr><th>stage</th><th>median ms</th><th>p10..p90 ms</th></tr></thead>"
                f"<tbody>{''.join(rows)}</tbody></table>")


def memory_of(scheduler) -> dict[str, int]:
    """Pinned and device bytes allocated by the rings (each ring's buffer, whose slots may lie
    farther apart than their bytes), and the most bytes of their slots in use at once."""
    pinned = device = pinned_hw = device_hw = 0
    for ring in scheduler.rings:
        if ring.external:  # the caller's registered memory, not ours
            continue
        size = ring.buffer.nbytes
        hw = ring.high_water * ring.chunk_bytes
        if ring.buffer.is_host:
            pinned, pinned_hw = pinned + size, pinned_hw + hw
        else:
            device, device_hw = device + size, device_hw + hw
    return {"pinned allocated": pinned, "pinned high-water": pinned_hw, "device allocated": device,
            "device high-water": device_hw}

