"""Whole-array jobs over several devices: ``stream_map`` and ``MapJob`` with ``device=`` a list.

The rows of ``x`` (axis 0) are split into one contiguous **shard** per device, balanced by rows,
and each shard runs as an ordinary whole-array job on its own device: its own engine, streams and
rings, its own registration of its rows (``x[a:b]`` and ``out[a:b]`` are views, C-contiguous
where ``x`` and ``out`` are), writing its rows of ``out``. A whole-array call blocks the thread
that drives it, so every shard runs on a thread of its own (:func:`run_shards`) and they run side
by side; the caller waits for all of them.

>>> import numpy as np, ringflow as rf
>>> def f(x, y):
...     y[:] = x * 2 + 1
>>> x = np.arange(1 << 16, dtype=np.float32)
>>> devs = [rf.device("sim"), rf.device("sim")]          # two simulated GPUs, one link each
>>> y = rf.stream_map(f, x, device=devs, chunk_bytes=1 << 14)
>>> bool(np.array_equal(y, x * 2 + 1))
True

Failures: every shard is settled (it finished or failed) before the call returns or raises, so
nothing still touches ``x`` or ``out`` afterwards. The error raised is that of the first failed
shard in row order (an interrupt, KeyboardInterrupt or SystemExit, before any other): a
:class:`~ringflow.StageError` is raised again with its chunk index counted over the whole call
in row order (the chunks every earlier shard ran, as its engine cut them, then the failed one's
place in its shard) and the device and rows named; a :class:`~ringflow.DeviceError` is raised
as a new one naming the device, the original as ``__cause__``; anything else gets a note naming
the device.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import json
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .. import _jsontext as jsontext
from .._device import device_label, host_pool
from .._device.protocol import Device
from .._errors import DeviceError, LaunchError, OutOfMemoryError, StageError, describe
from .._files import check_file_name, write_whole
from .._plan import split_rows
from .engine import Arrays, choose_engine
from .sigint import shielded
from .._shared_threads import SharedThreads
from .sizing import default_workers
from .whole_array import MapLayout, run_whole

# Threads that run shards. Shared by every call and reused, so a call pays no thread start-up and
# the simulated GPU's checker meets a bounded set of host threads. Bounded only as a guard: a
# call's shards queue behind other calls' rather than fail when every thread is busy.
_MAX_THREADS = 64
_SHARD_THREADS = SharedThreads(_MAX_THREADS, "ringflow-shard")


def _threads() -> concurrent.futures.ThreadPoolExecutor:
    return _SHARD_THREADS.get()


# .running: this thread runs a shard now (set by _run_shard). A call over several devices made
# from inside a shard (a compute running one of its own) waits for its shards while holding a
# thread of the shared pool: queued there, behind shards whose threads all wait the same way,
# they could never start, so such a call's shards get threads of their own (run_shards)
_in_shard = threading.local()


@dataclasses.dataclass(frozen=True)
class Shard:
    """Rows ``start:stop`` of the arrays on ``device``, planned in chunks of ``rows`` rows (the
    last may be shorter; the engine of a compute-bound job cuts shorter ones at both ends, so
    its calls may run more: see :func:`raise_first`). It copies host memory with
    ``copy_threads`` threads (its workers when it stages, else none), which :func:`run_shards`
    declares to its device's host while the shards run."""

    position: int
    device: Device
    label: str
    start: int
    stop: int
    rows: int
    chunk_bytes: int
    copy_threads: int = 0

    @property
    def n_chunks(self) -> int:
        """The chunks planned, untapered."""
        return -(-(self.stop - self.start) // self.rows)

    def chunk_rows(self, k: int) -> tuple[int, int]:
        """The rows of the whole array that this shard's chunk ``k`` covers, planned untapered."""
        a = self.start + k * self.rows
        return a, min(a + self.rows, self.stop)


def plan_shards(f: Callable, x: np.ndarray, out: np.ndarray, fresh_out: bool, devices: Sequence[Device], chunk_bytes,
                host: str, engine: str, opts: dict, *, pins_once: bool = False) -> list[Shard]:
    """Cut a non-empty job into shards, one per device (fewer when ``x`` has fewer rows than
    there are devices; the devices left over get nothing). Every shard is cut into chunks of the
    same rows, planned once for a shard's share of the array (``chunk_bytes="auto"`` included).
    ``pins_once``: as :meth:`MapLayout.plan` takes it (true for a ``MapJob``'s shards).

    Raises:
        ValueError: as :meth:`MapLayout.plan` (a row larger than a chunk, registration of
            strided arrays) and :func:`choose_engine` (``engine="direct"`` where it cannot run).
    """
    n = x.shape[0]
    share = -(-n // min(len(devices), n))
    probe = MapLayout.plan(f, x[:share], out[:share], fresh_out, devices[0], chunk_bytes, host, None, None, opts,
                           engine=engine, pins_once=pins_once)
    choose_engine(engine, probe.strategy, probe.engine_options(opts))  # refused once, not once per shard
    shards = []
    for i, (a, b) in enumerate(split_rows(n, len(devices), probe.rows)):
        rows = min(probe.rows, b - a)
        label = device_label(devices[i])
        label = label if label[:1] != "<" else f"device[{i}] {label}"  # a device without a name: its place
        threads = (opts.get("workers") or default_workers(devices[i])) if probe.strategy == "stage" else 0
        # the probe's slot size: each shard's layout then cuts the same rows (the wider of a row of
        # x and a row of the result sets them)
        shards.append(Shard(i, devices[i], label, a, b, rows, probe.chunk_bytes, threads))
    return shards


def host_for_shards(x: np.ndarray, out: np.ndarray, fresh_out: bool, host: str, x_buffer, out_buffer) -> str:
    """The ``host`` strategy the shards are asked for. Arrays from :mod:`ringflow.host` are
    pinned for one device; over several they are staged (pinning them again would fail).

    Raises:
        ValueError: ``x_buffer``/``out_buffer`` (one device's pinned memory), or
            ``host="register"`` for arrays from :mod:`ringflow.host`.
    """
    if x_buffer is not None or out_buffer is not None:
        raise ValueError("x_buffer and out_buffer are one device's pinned memory, and device= names several: "
                         "pass ordinary arrays (host='register' pins each device's rows for the call), or one device")
    pooled = host_pool.owner_of(x) is not None or (not fresh_out and host_pool.owner_of(out) is not None)
    if pooled and host == "register":
        raise ValueError("host='register' cannot pin arrays from ringflow.host again (they are pinned for one "
                         "device already); over several devices use host='stage' or 'auto', or ordinary arrays")
    return "stage" if pooled and host == "auto" else host


@dataclasses.dataclass
class Outcome:
    """How one shard ended: its value or error, and the time it took on its device's clock (s)."""

    value: Any = None
    error: Optional[BaseException] = None
    started: float = 0.0  # on the device's clock
    elapsed_s: float = 0.0
    token: Any = None


def _run_shard(shard: Shard, works: list, caller_token: Any) -> Outcome:
    """``work(shard)`` (``works``: a list holding ``work``, taken out here) as an :class:`Outcome`.
    The thread pool's frame that calls this keeps its arguments, and is the caller of the frames in
    a failure's traceback: handed over in a list taken empty, ``work`` (which holds the call's
    arrays) is not kept there for as long as the caller keeps the failure."""
    work, dev, outcome = works.pop(), shard.device, Outcome()
    _in_shard.running = True
    try:
        dev.observe(caller_token)  # ordered after everything the caller did on this device
        outcome.started = dev.now
        try:
            outcome.value = work(shard)
        finally:
            outcome.elapsed_s = dev.now - outcome.started
            outcome.token = dev.publish()
    except BaseException as exc:  # noqa: BLE001 - every ending is reported to the caller, Ctrl-C included
        outcome.error = exc
    finally:
        _in_shard.running = False
    try:
        return outcome
    finally:
        # where the shard failed this frame is in the error's traceback, and the outcome keeps
        # the error: a local keeping the outcome would make a cycle
        del outcome


def _wait(futures: list) -> None:
    """Wait for every shard (a separate function so tests can interrupt the wait)."""
    concurrent.futures.wait(futures)


def _settle(futures: list) -> None:
    """Wait for every shard even through further interrupts: returning while a shard runs would
    leave it writing ``out`` behind the caller's back."""
    while True:
        try:
            concurrent.futures.wait(futures)
            return
        except BaseException:  # noqa: BLE001 - a second Ctrl-C must not abandon running shards
            continue


def run_shards(shards: Sequence[Shard], work: Callable[[Shard], Any],
               undo: Optional[Callable[[Any], None]] = None) -> list[Outcome]:
    """Run ``work(shard)`` for every shard at once, each on a thread of its own in a copy of the
    caller's context; returns each shard's :class:`Outcome` once every shard has ended. If the
    caller is interrupted while it waits (any BaseException), every shard is still settled before
    the interrupt propagates. Every shard's host copies are declared to its device
    (``Device.sharing_host``) before any shard starts and until every shard has ended, so the
    simulated GPUs of one host share its copy rate for the whole call.

    On the main thread a Ctrl-C is deferred (:func:`shielded`) until every shard has ended and
    raised then: one landing between a shard's start and its future's being kept would leave
    that shard running unwaited for, and one inside ``concurrent.futures.wait``, which takes
    each future's lock in turn, could leave a lock taken that the shard's thread needs to end.
    A second Ctrl-C is raised at once (one landing as a shard is handed to its thread is held
    until the shard's future is kept), and the shards are still settled before it propagates.
    ``undo``: called with the value of every shard that succeeded when the call raises anyway
    (an interrupt), so that what the shards made is released rather than lost.

    Called from inside a shard (a compute making a call over several devices of its own), the
    shards run on threads started for this call, not on the shared pool."""
    nested = getattr(_in_shard, "running", False)
    pool = concurrent.futures.ThreadPoolExecutor(len(shards), "ringflow-shard-inner") if nested else _threads()
    try:
        return _run_on(pool, shards, work, undo)
    finally:
        if nested:
            pool.shutdown(wait=False)  # every shard has ended: its threads exit as they find no work


def _run_on(pool: concurrent.futures.ThreadPoolExecutor, shards: Sequence[Shard], work: Callable[[Shard], Any],
            undo: Optional[Callable[[Any], None]]) -> list[Outcome]:
    """:func:`run_shards` on the threads of ``pool``."""
    tokens = [s.device.publish() for s in shards]
    futures: list = []
    try:
        with shielded() as shield, contextlib.ExitStack() as sharing:
            for shard in shards:
                sharing.enter_context(shard.device.sharing_host(shard.copy_threads))
            try:
                for shard, token in zip(shards, tokens):
                    ctx = contextvars.copy_context()
                    # from the submit until its future is kept a second Ctrl-C is recorded, not
                    # raised (as while a lock is held for a moment): raised as the submit
                    # returns, it would leave that shard running unwaited for, and inside the
                    # executor's submit it could leave one of its locks taken
                    if shield is not None:
                        shield.holding += 1
                    try:
                        futures.append(pool.submit(ctx.run, _run_shard, shard, [work], token))
                    finally:
                        if shield is not None:
                            shield.holding -= 1
                _wait(futures)
            except BaseException:
                _settle(futures)
                raise
    except BaseException:
        if undo is not None:
            with shielded() as shield:
                if shield is not None:
                    shield.settle()  # a further Ctrl-C is raised once everything made is released
                for fut in futures:
                    outcome = fut.result()  # every future kept has ended (settled above)
                    if outcome.error is None and outcome.value is not None:
                        undo(outcome.value)
        raise
    outcomes = [fut.result() for fut in futures]
    for shard, outcome in zip(shards, outcomes):
        shard.device.observe(outcome.token)  # the caller is ordered after each shard's last work
    return outcomes


def named_error(shard: Shard, exc: BaseException, first_chunk: int = 0) -> BaseException:
    """``exc`` (raised by ``shard``) as the caller sees it: see the module doc. ``first_chunk``:
    the chunks the shards before ``shard`` ran in the call, so a StageError's chunk ``k`` of the
    shard is chunk ``first_chunk + k`` of the call."""
    where = f"on {shard.label}, whose shard is x[{shard.start}:{shard.stop}]"
    if isinstance(exc, StageError):
        # the shard's engine says which of its rows the chunk held (tapered chunks are not
        # index times rows); the shard's own cut where it could not
        a, b = ((shard.start + exc.rows[0], shard.start + exc.rows[1]) if exc.rows is not None
                else shard.chunk_rows(exc.index))
        new = StageError(exc.stage, first_chunk + exc.index, exc.__cause__)
        new.args = (f"{new.args[0]} (on {shard.label}, rows x[{a}:{b}])",)
        new.device, new.rows = shard.device, (a, b)  # type: ignore[attr-defined]
        return new
    if isinstance(exc, DeviceError):
        # keep the kind: an out-of-memory must stay a MemoryError (and never sticky)
        cls = type(exc) if type(exc) in (DeviceError, LaunchError, OutOfMemoryError) else DeviceError
        new = cls(f"{exc} ({where})", sticky=exc.sticky)
        new.__cause__ = exc
        new.device = shard.device  # type: ignore[attr-defined]
        return new
    exc.add_note(f"raised {where}")
    return exc


def raise_first(shards: Sequence[Shard], outcomes: Sequence[Outcome],
                ran: Optional[Sequence[Optional[int]]] = None) -> None:
    """Raise the error of the first failed shard in row order (an interrupt first), named for
    the caller; return if none failed. ``ran``: the chunks each shard's call ran (None, or a
    None in it, where not known: the shard's planned chunks are counted instead), which number a
    StageError's chunk over the call. The errors are taken out of ``outcomes``: the frames of
    the raise (and their callers, which hold ``outcomes``) are in the raised error's traceback,
    and an interrupt is raised as itself, so an outcome keeping it would make a cycle."""
    err = _first_error(shards, outcomes, ran)
    if err is None:
        return
    try:
        raise err
    finally:
        del err  # this frame is in its traceback


def _first_error(shards: Sequence[Shard], outcomes: Sequence[Outcome],
                 ran: Optional[Sequence[Optional[int]]]) -> Optional[BaseException]:
    """What :func:`raise_first` raises (None if no shard failed); clears every outcome's error."""
    failed = [(s, o.error) for s, o in zip(shards, outcomes) if o.error is not None]
    for o in outcomes:
        o.error = None
    if not failed:
        return None
    interrupts = [(s, e) for s, e in failed if not isinstance(e, Exception)]
    shard, exc = (interrupts or failed)[0]
    # the shards before a StageError's all finished (it is the first failure in row order), so
    # each ran every chunk its engine cut: a compute-bound one's tapered chunks are more than
    # its planned ones
    ran = ran if ran is not None else [None] * len(shards)
    first = sum(s.n_chunks if n is None else n for s, n in zip(shards[:shard.position], ran))
    err = named_error(shard, exc, first)
    others = [f"{s.label}: {describe(e)}" for s, e in failed if s is not shard]
    if others:
        err.add_note(f"{len(others)} other shard(s) failed too: " + "; ".join(others))
    return err


@dataclasses.dataclass(repr=False)
class ShardedReport:
    """The profile of one call over several devices: a :class:`~ringflow.Report` per shard and
    the call's time. Shards run side by side, each on its own device's clock (virtual on the
    simulated GPU, where each device has its own link and clock), so the call takes as long as
    its slowest shard.

    Attributes:
        reports: each shard's :class:`~ringflow.Report`, in row order.
        devices: each shard's device, named (``"cuda:1"``, ``"sim:0"``, or its repr).
        rows: each shard's rows ``(start, stop)`` of ``x``.
        elapsed_s: each shard's time on its device's clock (s), from its start to its end
            (registration included).
        lead_s: each shard's time from its start to its first chunk (set-up, registration).
        simulated: every device is a simulated GPU (the times are predictions).
    """

    reports: tuple
    devices: tuple
    rows: tuple
    elapsed_s: tuple
    lead_s: tuple
    simulated: bool

    @property
    def wall_s(self) -> float:
        """The call's time (s): the largest shard's elapsed time."""
        return max(self.elapsed_s)

    @property
    def predicted_s(self) -> Optional[float]:
        """:attr:`wall_s` on simulated GPUs (the model's prediction); None on real ones."""
        return self.wall_s if self.simulated else None

    @property
    def chunks(self) -> int:
        return sum(r.chunks for r in self.reports)

    @property
    def bytes_in(self) -> int:
        return sum(r.bytes_in for r in self.reports)

    @property
    def throughput_GBps(self) -> float:
        """Bytes in over :attr:`wall_s`, in GB/s."""
        return self.bytes_in / self.wall_s / 1e9 if self.wall_s > 0 else 0.0

    def headline(self) -> str:
        slowest = self.devices[self.elapsed_s.index(self.wall_s)]
        return (f"{len(self.reports)} devices, {self.chunks} chunks, {self.bytes_in / 1e6:.1f} MB in "
                f"{self.wall_s * 1e3:.3f} ms{' (simulated)' if self.simulated else ''}, slowest {slowest}")

    def as_dict(self) -> dict[str, Any]:
        """The call's figures and each device's report (:meth:`Report.as_dict`) as plain values
        for JSON (a figure that does not exist is None)."""
        return jsontext.plain({"devices": list(self.devices), "rows": [list(r) for r in self.rows],
                "elapsed_s": list(self.elapsed_s), "wall_s": self.wall_s, "predicted_s": self.predicted_s,
                "throughput_GBps": self.throughput_GBps, "reports": [r.as_dict() for r in self.reports]})

    def to_chrome(self) -> dict[str, Any]:
        """One Chrome/Perfetto trace of the call: a process (``pid``) per device, named after it,
        with that shard's tracks; every device's time starts at 0 where the call started."""
        from .._trace.chrome import to_chrome

        events: list = []
        meta: dict = {}
        for i, (report, label, lead) in enumerate(zip(self.reports, self.devices, self.lead_s)):
            one = to_chrome(report.timeline, name=f"ringflow on {label}")
            lead_us = lead * 1e6  # a shard's trace counts from its first chunk, not from the call's start
            for ev in one["traceEvents"]:
                ev = dict(ev, pid=i + 1)
                if ev.get("ph") == "X":
                    ev["ts"] = ev["ts"] + lead_us
                events.append(ev)
            events.append({"ph": "M", "pid": i + 1, "name": "process_sort_index", "args": {"sort_index": i + 1}})
            meta[label] = one["otherData"]
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}

    def plot(self, path: Optional[str] = None) -> Any:
        """One Gantt chart per device, stacked in one figure (a track group per device), each
        titled with its device and headline.

        Args:
            path: where to save the figure: a file name or an open binary file, its format from
                the name's extension (PNG without one); None saves nothing.

        Returns:
            the ``matplotlib.figure.Figure``.

        Raises:
            RuntimeError: matplotlib is not installed.
            TypeError: ``path`` is neither None, a file name nor an open binary file (said
                before drawing).
            ValueError: ``path`` names a file type matplotlib cannot write (said before drawing).
            OSError: the file cannot be written, or is a device, pipe or socket.
        """
        if path is not None:
            check_file_name(path, "plot", file_objects=True)
        try:
            from matplotlib.figure import Figure
        except ImportError as exc:
            raise RuntimeError("plot() needs matplotlib: pip install 'ringflow[plot]'") from exc
        from .._trace.plot import plot_format, save_figure

        file_type = plot_format(path, "plot") if path is not None else None
        fig = Figure(figsize=(12, 3.2 * len(self.reports)), layout="constrained")
        axes = fig.subplots(len(self.reports), 1, squeeze=False)[:, 0]
        for ax, report, label in zip(axes, self.reports, self.devices):
            report.plot(ax=ax)
            ax.set_title(f"{label}: {report.headline()}", fontsize=9)
        if path is not None:
            save_figure(fig, path, file_type)
        return fig

    def save_trace(self, path: str) -> str:
        """Write :meth:`to_chrome` as JSON (open it in ui.perfetto.dev); returns ``path``.

        Raises:
            TypeError: ``path`` is not a file name (a str or os.PathLike).
            OSError: the file cannot be written, or is a device, pipe or socket.
        """
        check_file_name(path, "save_trace")
        write_whole(path, json.dumps(self.to_chrome()))
        return path

    def __repr__(self) -> str:
        return (f"<ShardedReport {len(self.reports)} devices, {self.chunks} chunks in {self.wall_s * 1e3:.3f} ms, "
                f"elapsed {', '.join(f'{d}: {e * 1e3:.3f} ms' for d, e in zip(self.devices, self.elapsed_s))}>")

    def __str__(self) -> str:
        return "\n".join([self.headline()] + [f"  {d} rows {a}:{b}: {r.headline()}"
                                              for d, (a, b), r in zip(self.devices, self.rows, self.reports)])


def sharded_report(shards: Sequence[Shard], outcomes: Sequence[Outcome], reports: Sequence[Any]) -> ShardedReport:
    return ShardedReport(reports=tuple(reports), devices=tuple(s.label for s in shards),
                         rows=tuple((s.start, s.stop) for s in shards),
                         elapsed_s=tuple(o.elapsed_s for o in outcomes),
                         lead_s=tuple(max(0.0, r.timeline.start - o.started) for r, o in zip(reports, outcomes)),
                         simulated=all(getattr(s.device, "backend", None) == "sim" for s in shards))


def stream_map_sharded(f: Callable, x: np.ndarray, out: np.ndarray, fresh_out: bool, devices: Sequence[Device],
                       chunk_bytes, host: str, x_buffer, out_buffer, engine: str, keep_warm: bool, profile: bool,
                       opts: dict) -> tuple:
    """A checked, non-empty ``stream_map`` call over several devices; returns ``(out, report)``
    (a :class:`ShardedReport` when ``profile``, else None)."""
    host = host_for_shards(x, out, fresh_out, host, x_buffer, out_buffer)
    shards = plan_shards(f, x, out, fresh_out, devices, chunk_bytes, host, engine, opts)

    # (partials of module functions, not closures: see _shard_arrays)
    work = functools.partial(_stream_map_shard, f, x, out, fresh_out, host, engine, keep_warm, profile, opts)
    outcomes = run_shards(shards, work)
    raise_first(shards, outcomes, [None if o.value is None else o.value[1] for o in outcomes])
    return out, sharded_report(shards, outcomes, [o.value[0] for o in outcomes]) if profile else None


def _shard_arrays(x: np.ndarray, out: np.ndarray, shard: Shard) -> tuple:
    """``shard``'s rows of ``x`` and of ``out`` (``x``'s own, in place).

    A shard's work is a partial of a module function, not a closure over the call's arrays: a
    frame keeps its function, so a closure's frame in a failure's traceback would keep the
    arrays after its locals are cleared (frames.py), for as long as the caller keeps the error."""
    xs = x[shard.start:shard.stop]
    return xs, (xs if out is x else out[shard.start:shard.stop])


def _stream_map_shard(f, x, out, fresh_out, host, engine, keep_warm, profile, opts, shard: Shard) -> tuple:
    """One shard of :func:`stream_map_sharded`; returns its report (None without ``profile``)
    and the chunks it ran."""
    xs, outs = _shard_arrays(x, out, shard)
    return run_whole(f, xs, outs, fresh_out, shard.device, shard.chunk_bytes, host, None, None, engine,
                     keep_warm, profile, dict(opts), pooled_out=False)[1:]


def _make_part(part, f, x, out, fresh_out, host, engine, opts, shard: Shard) -> Any:
    """One shard's single-device job of :meth:`ShardedJob.build`."""
    xs, outs = _shard_arrays(x, out, shard)
    return part(f, xs, outs, fresh_out, shard.device, shard.chunk_bytes, host, engine, dict(opts))


def _close_part(part: Any) -> None:
    """Close one shard's job made by a set-up that was interrupted."""
    part.close()


def _call_part(parts: list, profile: bool, shard: Shard) -> int:
    """One shard's call of :meth:`ShardedJob.run`; returns the chunks it ran."""
    part = parts[shard.position]
    chunks = part.chunks  # before the call: a first call that finds the job compute-bound tapers the next
    part(profile=profile)
    return chunks


@dataclasses.dataclass(frozen=True)
class ShardedLayout:
    """What a ``MapJob`` over several devices tells of its layout: the shards' host strategy and
    engine (``"mixed"`` where they differ), its chunks over the whole array and their bytes."""

    strategy: str
    kind: str
    n_chunks: int
    chunk_bytes: int


def _common(values: Sequence[str]) -> str:
    return values[0] if len(set(values)) == 1 else "mixed"


class ShardedJob:
    """The engine of a ``MapJob`` over several devices: a single-device ``MapJob`` per shard,
    each holding its device's engine and registration for the job's life; a call runs them all
    at once. Implements the :class:`~ringflow._pipeline.engine.Engine` interface."""

    def __init__(self, shards: list[Shard], parts: list) -> None:
        self.shards, self.parts = shards, parts
        self.devices = tuple(s.device for s in shards)
        self.layout = ShardedLayout(strategy=_common([p.strategy for p in parts]),
                                    kind=_common([p.engine for p in parts]),
                                    n_chunks=sum(p.chunks for p in parts), chunk_bytes=shards[0].chunk_bytes)
        self._last: Optional[list[Outcome]] = None
        self._profiled = False

    @classmethod
    def build(cls, f: Callable, x: np.ndarray, out: np.ndarray, fresh_out: bool, devices: Sequence[Device],
              chunk_bytes, host: str, x_buffer, out_buffer, engine: str, opts: dict,
              part: Callable[..., Any]) -> "ShardedJob":
        """Set a job up on every device at once (``part`` makes one shard's single-device job).

        Raises:
            TypeError, ValueError: a bad argument; the first shard's set-up error (all of them
                settled and the ones made closed first).
        """
        host = host_for_shards(x, out, fresh_out, host, x_buffer, out_buffer)
        shards = plan_shards(f, x, out, fresh_out, devices, chunk_bytes, host, engine, opts, pins_once=True)

        outcomes = run_shards(shards, functools.partial(_make_part, part, f, x, out, fresh_out, host, engine, opts),
                              undo=_close_part)
        if any(o.error is not None for o in outcomes):
            for o in outcomes:
                if o.value is not None:
                    o.value.close()
            raise_first(shards, outcomes)
        try:
            return cls(shards, [o.value for o in outcomes])
        except BaseException:  # a Ctrl-C: the jobs made are closed, not left to the garbage collector
            for o in outcomes:
                o.value.close()
            raise

    @property
    def n_chunks(self) -> int:
        """Every shard's chunks the next call runs (more than at set-up once a first call has
        found shards compute-bound and tapered them)."""
        return sum(p.chunks for p in self.parts)

    @property
    def enqueue_seconds(self) -> Optional[float]:
        """The largest shard's host time enqueueing its chunks in the last call (direct engine)."""
        seconds = [p.enqueue_seconds for p in self.parts]
        return None if None in seconds else max(seconds)

    def run(self, arrays: Arrays, *, profile: bool = False) -> None:
        self._last = None
        outcomes = run_shards(self.shards, functools.partial(_call_part, self.parts, profile))
        self._last, self._profiled = outcomes, profile
        raise_first(self.shards, outcomes, [o.value for o in outcomes])

    def report(self) -> ShardedReport:
        if self._last is None or not self._profiled:
            raise RuntimeError("no profiled call to report on: call the job with profile=True first")
        return sharded_report(self.shards, self._last, [p.report() for p in self.parts])

    def fail(self, exc: BaseException) -> None:
        self.close()  # run settled every shard before it raised

    def park(self) -> bool:
        return True

    def close(self) -> None:
        for p in self.parts:
            p.close()
