"""``ringflow trace FILE``: what a saved trace says, without opening a browser.

The trace is a Chrome/Perfetto JSON as :meth:`Report.save_trace` writes it: one track (thread)
per stage, stream or stall lane, each span a complete event (``ph: "X"``). Spans of one name
that overlap in time sit on numbered tracks (``cpu: prepare``, ``cpu: prepare [1]``, ...), so
the number of tracks a name uses is how many of its spans ran at once at most. In a trace whose
spans overlap on one track (nested spans, another writer's trace) the most that ran at once
count as its tracks.

A long run's trace is hundreds of megabytes: it is read as a stream, one event at a time, and
only each span's figures are kept, in arrays (:func:`read_figures`), so the memory it takes is
a small fraction of the file's size. A file the stream cannot take as a valid trace (any error,
or a shape such as a key given twice) is read whole by :func:`read_spans`, which raises the
error that names what is wrong.
"""

from __future__ import annotations

import array
import dataclasses
import itertools
import json
import math
import os
import re
import sys
from typing import Any, Iterator

import numpy as np

from .. import _jsontext as jsontext
from .._files import is_special, printable, too_large
from .timeline import STAGES, Span

READ_CHARS = 1 << 16  # characters read from the file at a time (an event larger than this is read whole)
_GPU = ("h2d", "compute", "d2h")
_INT64 = (-(1 << 63), (1 << 63) - 1)

LEGEND = {
    "wall_ms": "wall time: from the first span's start to the last span's end",
    "count": "spans of that name (one per chunk for the five stages)",
    "median_ms": "median span duration",
    "total_ms": "sum of the span durations",
    "tracks": "threads or lanes the spans lie on (or the most that ran at once, if more); at most this many ran at once",
    "busy_fraction": "share of the wall time with at least one such span running (at most 100%)",
    "per_track_fraction": "total / (tracks x wall): the average load of each track (at most 100%)",
    "gpu_overlap": "h2d + compute + d2h span time / time any of them ran: 1 = one at a time, 3 = all three always",
}


def _fail(path: str, what: str) -> ValueError:
    return ValueError(f"{path} is not a Chrome trace: {what} (write one with Report.save_trace or "
                      "ringflow bench --trace)")


def _number(e: dict, key: str, default: "float | None" = None) -> "float | None":
    v = e.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _json_kind(value: Any) -> str:
    """What JSON calls the kind of a value json.loads made: 'number', 'string', 'null', ..."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", type(None): "null", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def read_spans(path: str) -> list[Span]:
    """The complete events of the Chrome trace at ``path`` as spans (seconds from its zero),
    each on the track its process's thread is named.

    Raises:
        OSError, ValueError: as :func:`read_process_spans`.
    """
    return [span for _, span in read_process_spans(path)]


def read_process_spans(path: str) -> list[tuple[Any, Span]]:
    """:func:`read_spans` with the process (``pid``) of each span: ``(pid, span)`` pairs. Thread
    ids are each process's own (a trace of several devices has a process per device).

    Raises:
        OSError: the file cannot be opened (missing, a folder, no permission).
        ValueError: it is empty, not JSON, or not shaped like a Chrome trace; the message
            names the file and the first event that is wrong.
    """
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder; give the trace JSON file inside it")
    if is_special(path):
        raise _fail(path, "it is not a regular file")
    try:
        with open(path, encoding=jsontext.ENCODING) as fh:
            text = fh.read()
        if not text.strip():
            raise _fail(path, "the file is empty")
        data = jsontext.loads(text)
    except UnicodeDecodeError:
        raise _fail(path, "it is not a UTF-8 text file") from None
    except json.JSONDecodeError as exc:
        raise _fail(path, f"not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except MemoryError:
        text = None  # what was read goes before the message is made
        raise ValueError(f"trace {too_large(path)}; summarise the trace of a shorter run") from None
    if isinstance(data, dict):
        if "traceEvents" not in data:
            raise _fail(path, "a JSON object without a 'traceEvents' list")
        events = data["traceEvents"]
    else:
        events = data
    if not isinstance(events, list):
        if not isinstance(data, dict):  # a file of one value has no 'traceEvents' to blame
            raise _fail(path, f"a JSON {_json_kind(data)}, not an object with a 'traceEvents' list nor a list of "
                              "events")
        raise _fail(path, f"'traceEvents' must be a list of events, got {type(events).__name__}")
    names: dict[Any, str] = {}
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise _fail(path, f"event {i} is not a JSON object (got {type(e).__name__})")
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            args = e.get("args")
            if not isinstance(args, dict) or not isinstance(args.get("name"), str):
                raise _fail(path, f"event {i} (a thread_name) has no args.name string")
            names[_key(e.get("pid")), _key(e.get("tid"))] = args["name"]
    out = []
    for i, e in enumerate(events):
        if e.get("ph") != "X":
            continue
        ts, dur = _number(e, "ts"), _number(e, "dur", 0.0)
        if ts is None:
            raise _fail(path, f"event {i} has no numeric 'ts' (its start in microseconds), got {e.get('ts')!r}")
        if dur is None or dur < 0:
            raise _fail(path, f"event {i} has a 'dur' that is not a duration >= 0 in microseconds: {e.get('dur')!r}")
        args = e.get("args", {})
        if not isinstance(args, dict):
            raise _fail(path, f"event {i} has 'args' that are not a JSON object")
        chunk = args.get("chunk")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)):
            raise _fail(path, f"event {i} has args.chunk {chunk!r}, not a chunk index")
        name = e.get("cat", e.get("name"))
        if not isinstance(name, str):
            raise _fail(path, f"event {i} has no 'cat' or 'name' string")
        pid = _key(e.get("pid"))
        start = ts / 1e6
        out.append((pid, Span(names.get((pid, _key(e.get("tid"))), str(e.get("tid"))), name, start,
                              start + dur / 1e6, chunk, args)))
    return out


def _key(tid: Any) -> Any:  # (a pid as well)
    return tid if isinstance(tid, (int, str, float, type(None))) else json.dumps(tid, sort_keys=True)


@dataclasses.dataclass
class Figures:
    """The spans of a trace as :func:`summarise` needs them: arrays of one entry per span, in
    the file's order, instead of a :class:`Span` (and its event's dict) each.

    Attributes:
        start, end: seconds from the trace's zero (float64).
        name: each span's name, an index into ``names`` (C int).
        track: each span's track, an index into ``tracks`` (C int).
        names, tracks: the distinct names and tracks.
        first, last: the smallest start and the largest end, as ``min`` and ``max`` of the
            spans give them (None without spans).
        chunks: how many distinct chunks the spans of the five stages name (a chunk index is
            its process's own).
    """

    start: np.ndarray
    end: np.ndarray
    name: np.ndarray
    track: np.ndarray
    names: list
    tracks: list
    first: "float | None"
    last: "float | None"
    chunks: int


class _Unread(Exception):
    """The stream cannot take the file as a valid trace: it is read whole instead."""


class _Collect:
    """Span figures gathered one event at a time (see :class:`Figures`)."""

    def __init__(self) -> None:
        self.start, self.end = array.array("d"), array.array("d")
        self.name, self.tid = array.array("i"), array.array("i")
        self.name_of: dict = {}
        self.tid_of: dict = {}  # one entry per distinct thread id as written, for its track's name
        self.tid_values: list = []  # (pid, tid) of each
        self.thread_names: dict = {}  # (pid, tid) -> name, by _key
        # a stage span's chunk index, and its process as an index into process_of
        self.chunks, self.chunk_process, self.big_chunks = array.array("q"), array.array("i"), set()
        self.process_of: dict = {}
        self.first = self.last = None

    def add(self, track_key: Any, tid: Any, name: str, start: float, end: float, chunk: "int | None",
            pid: Any = None) -> None:
        """One span of process ``pid`` (by :func:`_key`) on its thread ``tid``; ``track_key`` tells
        the thread from every other as written in the file."""
        at = self.tid_of.get(track_key)
        if at is None:
            at = self.tid_of[track_key] = len(self.tid_values)
            self.tid_values.append((pid, tid))
        self.tid.append(at)
        self.name.append(self.name_of.setdefault(name, len(self.name_of)))
        self.start.append(start)
        self.end.append(end)
        # as min() and max() of the spans: the first of equal values kept
        if self.first is None or start < self.first:
            self.first = start
        if self.last is None or end > self.last:
            self.last = end
        if chunk is not None and name in STAGES:
            process = self.process_of.setdefault(pid, len(self.process_of))
            if _INT64[0] <= chunk <= _INT64[1]:
                self.chunks.append(chunk)
                self.chunk_process.append(process)
            else:
                self.big_chunks.add((process, chunk))

    def figures(self) -> Figures:
        """What was gathered, each track named by its thread's name (the last one the file gives)."""
        track_of: dict = {}
        per_tid = [track_of.setdefault(self.thread_names.get((p, _key(t)), str(t)), len(track_of))
                   for p, t in self.tid_values]
        track = np.asarray(per_tid, dtype=np.intc)[_array(self.tid, np.intc)]
        chunks, process = _array(self.chunks, np.int64), _array(self.chunk_process, np.intc)
        # distinct chunks of each process in turn: a trace of one device (most) is counted as
        # one array, with no (process, chunk) pairs made for a trace of millions of spans
        distinct = (len(np.unique(chunks)) if len(self.process_of) <= 1 else
                    sum(len(np.unique(chunks[process == p])) for p in range(len(self.process_of))))
        return Figures(start=_array(self.start, np.float64), end=_array(self.end, np.float64),
                       name=_array(self.name, np.intc), track=track, names=list(self.name_of),
                       tracks=list(track_of), first=self.first, last=self.last,
                       chunks=distinct + len(self.big_chunks))


def _array(values: "array.array", dtype: Any) -> np.ndarray:
    """``values`` as a numpy array, without a copy (an empty one made: a buffer of none is refused)."""
    return np.frombuffer(values, dtype=dtype) if len(values) else np.zeros(0, dtype)


def read_figures(path: str) -> Figures:
    """The complete events of the Chrome trace at ``path`` as :class:`Figures`, read as a
    stream; a file the stream cannot take is read whole (:func:`read_spans`) for its error.

    Args:
        path: the trace JSON file.

    Raises:
        OSError, ValueError: as :func:`read_spans`.
    """
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder; give the trace JSON file inside it")
    if is_special(path):
        raise _fail(path, "it is not a regular file")
    try:
        return _stream_figures(path)
    except _Unread:
        pass
    except MemoryError:
        raise ValueError(f"trace {too_large(path)}; summarise the trace of a shorter run") from None
    except UnicodeDecodeError:
        pass  # (read whole, which names it)
    collect = _Collect()
    for pid, s in read_process_spans(path):  # an error raised here names what is wrong; a trace it takes is summarised
        collect.add(s.track, s.track, s.name, s.start, s.end, s.chunk, pid)
    return collect.figures()


def _stream_figures(path: str) -> Figures:
    """:func:`read_figures` of a file the stream takes.

    Raises:
        _Unread: the file is not a valid trace, or not one the stream reads (the caller reads it whole).
        OSError, UnicodeDecodeError, MemoryError: reading the file.
    """
    collect = _Collect()
    with open(path, encoding=jsontext.ENCODING) as fh:
        for e in _trace_events(_Text(fh)):
            if not isinstance(e, dict):
                raise _Unread
            ph = e.get("ph")
            if ph == "M" and e.get("name") == "thread_name":
                args = e.get("args")
                if not isinstance(args, dict) or not isinstance(args.get("name"), str):
                    raise _Unread
                collect.thread_names[_key(e.get("pid")), _key(e.get("tid"))] = args["name"]
            if ph != "X":
                continue
            ts, dur = _number(e, "ts"), _number(e, "dur", 0.0)
            if ts is None or dur is None or dur < 0:
                raise _Unread
            args = e.get("args", {})
            if not isinstance(args, dict):
                raise _Unread
            chunk = args.get("chunk")
            if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)):
                raise _Unread
            name = e.get("cat", e.get("name"))
            if not isinstance(name, str):
                raise _Unread
            tid = e.get("tid")
            # a thread id written differently (1 and 1.0, keys in another order) names one
            # thread but is shown as written where the thread has no name
            kind = type(tid)
            key = (kind, tid) if kind in (int, str, float, bool, type(None)) else (kind, _key(tid), str(tid))
            pid = _key(e.get("pid"))  # thread ids are each process's own
            start = ts / 1e6
            collect.add((pid, key), tid, name, start, start + dur / 1e6, chunk, pid)
    return collect.figures()


_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace


class _Text:
    """A text file read a piece at a time, JSON values decoded from it one at a time."""

    def __init__(self, fh) -> None:
        self.fh, self.buf, self.pos, self.eof = fh, "", 0, False
        self.decoder = json.JSONDecoder(parse_int=jsontext._integer)

    def _more(self) -> None:
        if self.eof:
            raise _Unread
        # at least as much again as is left unread: a value longer than a piece is read in few steps
        piece = self.fh.read(max(READ_CHARS, len(self.buf) - self.pos))
        self.buf = self.buf[self.pos:] + piece
        self.pos = 0
        self.eof = not piece

    def peek(self) -> str:
        """The next character that is not JSON whitespace ("" at the end of the file)."""
        while True:
            self.pos = _SPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or self.eof:
                return self.buf[self.pos:self.pos + 1]
            self._more()

    def take(self, char: str) -> None:
        if self.peek() != char:
            raise _Unread
        self.pos += 1

    def value(self) -> Any:
        """The next JSON value."""
        self.peek()
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
            except (ValueError, RecursionError):  # cut short by the piece's end, or not JSON
                self._more()
                continue
            if end < len(self.buf) or self.eof:  # (a number at the piece's end may go on)
                self.pos = end
                return value
            self._more()


def _trace_events(text: _Text) -> Iterator[Any]:
    """The events of a Chrome trace, a JSON list or an object whose ``traceEvents`` is a list.

    Raises:
        _Unread: the text is no such trace, or not JSON, or names ``traceEvents`` twice.
    """
    first = text.peek()
    if first == "[":
        yield from _items(text)
    elif first == "{":
        text.take("{")
        found = False
        if text.peek() != "}":
            while True:
                key = text.value()
                if not isinstance(key, str):
                    raise _Unread
                text.take(":")
                if key == "traceEvents":
                    if found or text.peek() != "[":  # (read whole, the last of two is kept)
                        raise _Unread
                    found = True
                    yield from _items(text)
                else:
                    text.value()
                if text.peek() != ",":
                    break
                text.take(",")
        text.take("}")
        if not found:
            raise _Unread
    else:
        raise _Unread
    if text.peek() != "":
        raise _Unread


def _items(text: _Text) -> Iterator[Any]:
    text.take("[")
    if text.peek() == "]":
        text.take("]")
        return
    while True:
        yield text.value()
        if text.peek() != ",":
            break
        text.take(",")
    text.take("]")


def summarise(path: str) -> dict[str, Any]:
    """What the trace at ``path`` says: per span name the count, durations, and how busy it was.

    Returns:
        ``{"file", "spans", "chunks", "wall_ms", "stages": {name: {"count", "tracks",
        "median_ms", "total_ms", "busy_fraction", "per_track_fraction"}}, "gpu_busy_union_ms",
        "gpu_overlap", "legend"}`` (times in milliseconds, fractions 0..1; :data:`LEGEND`
        says what each figure means). A trace without spans gives ``spans == 0`` and no stages.

    Raises:
        OSError, ValueError: as :func:`read_spans`.
    """
    fig = read_figures(path)
    n = len(fig.start)
    out: dict[str, Any] = {"file": path, "spans": n, "chunks": 0, "wall_ms": 0.0, "stages": {},
                           "legend": dict(LEGEND)}
    if not n:
        return out
    wall = fig.last - fig.first
    out["chunks"] = fig.chunks
    out["wall_ms"] = wall * 1e3
    # the spans of each name, in the file's order
    by_name = np.argsort(fig.name, kind="stable")
    bounds = np.concatenate(([0], np.cumsum(np.bincount(fig.name, minlength=len(fig.names)))))
    order = {s: i for i, s in enumerate(STAGES)}
    for k, name in sorted(enumerate(fig.names), key=lambda kn: (order.get(kn[1], len(order)), kn[1])):
        group = by_name[bounds[k]:bounds[k + 1]]
        starts, ends = fig.start[group], fig.end[group]
        d = ends - starts
        # ringflow gives each of the spans that overlap a lane of its own; spans nested or
        # overlapping on one thread (another writer's trace) count as the most that ran at once,
        # so that total / (tracks x wall) stays a load of at most 1
        tracks = max(len(np.unique(fig.track[group])), _most_at_once(starts, ends))
        total = float(d.sum())
        out["stages"][name] = {
            "count": len(group), "tracks": tracks, "median_ms": float(np.median(d)) * 1e3, "total_ms": total * 1e3,
            "busy_fraction": _union(starts, ends) / wall if wall > 0 else 0.0,
            "per_track_fraction": total / (tracks * wall) if wall > 0 else 0.0}
    gpu_names = [k for k, name in enumerate(fig.names) if name in _GPU]
    if gpu_names:
        gpu = np.flatnonzero(np.isin(fig.name, gpu_names))
        starts, ends = fig.start[gpu], fig.end[gpu]
        union = _union(starts, ends)
        out["gpu_busy_union_ms"] = union * 1e3
        # added one by one in the file's order, as Python's sum adds floats
        out["gpu_overlap"] = sum(_python_floats(ends - starts)) / union if union > 0 else 1.0
    return out


def _python_floats(values: np.ndarray) -> Iterator[float]:
    """The entries of ``values`` as Python floats, a slice at a time (not one list of all)."""
    step = 1 << 16
    return itertools.chain.from_iterable(values[i:i + step].tolist() for i in range(0, len(values), step))


def _rounded(obj: Any) -> Any:
    """Floats to 6 significant digits: a clock's last bits are noise, not information."""
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    return obj


def _most_at_once(starts: np.ndarray, ends: np.ndarray) -> int:
    """The most of the spans ``starts[i]..ends[i]`` that run at any one time (one that ends as
    another starts does not overlap it)."""
    if not len(starts):
        return 0
    times = np.concatenate((starts, ends))
    steps = np.repeat(np.array([1, -1], dtype=np.int64), len(starts))
    order = np.lexsort((steps, times))  # by time, an end (-1) before a start (+1) at the same time
    return int(max(0, np.cumsum(steps[order]).max()))


def _union(starts: np.ndarray, ends: np.ndarray) -> float:
    """The time at least one of the spans ``starts[i]..ends[i]`` (each end >= its start) runs:
    the lengths of the runs of overlapping spans, added in time order one by one."""
    if not len(starts):
        return 0.0
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)  # the latest end so far: the end of the run a span is in
    new_run = np.flatnonzero(starts[1:] > reach[:-1]) + 1  # a span starting after it begins a run
    run_starts = starts[np.concatenate(([0], new_run))]
    run_ends = reach[np.concatenate((new_run - 1, [len(starts) - 1]))]
    return float(np.cumsum(run_ends - run_starts)[-1])  # (a running sum: one by one, in order)


def _figure(value: float, places: int) -> str:
    """``value`` with ``places`` decimals; from 1e15 on in powers of ten, and a sum that passed a
    float's range (durations near it, added up) as more than a float's largest value."""
    if not math.isfinite(value):
        return f">{sys.float_info.max:.1e}"
    # past 1e15 a float's digits end before the decimal point: written out, the rest are noise
    return f"{value:.{places}e}" if abs(value) >= 1e15 else f"{value:.{places}f}"


def print_summary(path: str, *, json_out: bool = False) -> int:
    """Print :func:`summarise` of ``path``: a table with a legend, or JSON on stdout.

    Returns:
        0.

    Raises:
        OSError, ValueError: as :func:`read_spans`.
    """
    info = summarise(path)
    if json_out:
        print(json.dumps(jsontext.plain(_rounded(info)), indent=2, allow_nan=False))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()  # the file's name and its spans' names are the user's text: shown through printable
    if not info["spans"]:
        console.print(f"{printable(path)}: a Chrome trace with no spans (no complete 'X' events)")
        return 0
    title = f"{printable(path)}: {info['chunks']} chunks in {_figure(info['wall_ms'], 3)} ms wall time"
    if "gpu_overlap" in info:
        title += f", GPU stage overlap x{info['gpu_overlap']:.2f}"
    t = Table(title=title)
    for col in ("span", "count", "median ms", "total ms", "busy", "tracks", "busy/track"):
        t.add_column(col, justify="left" if col == "span" else "right")
    for name, st in info["stages"].items():
        t.add_row(printable(name), str(st["count"]), _figure(st["median_ms"], 4), _figure(st["total_ms"], 3),
                  f"{st['busy_fraction'] * 100:.0f}%", str(st["tracks"]), f"{st['per_track_fraction'] * 100:.0f}%")
    console.print(t)
    legend = [("busy", LEGEND["busy_fraction"]), ("tracks", LEGEND["tracks"]),
              ("busy/track", LEGEND["per_track_fraction"])]
    if "gpu_overlap" in info:
        legend.append(("GPU stage overlap", LEGEND["gpu_overlap"]))
    for key, text in legend:
        console.print(f"[bold]{key}[/] = {text}", highlight=False)
    return 0
