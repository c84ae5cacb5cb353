"""Chrome / Perfetto trace JSON (opens in ui.perfetto.dev and chrome://tracing).

One process, one track (thread) per stage and per stream, plus one per kind of stall. Every
span is a complete event (``ph: "X"``) with microsecond ``ts``/``dur`` relative to the run's
first accepted chunk (or a stall that began before it: :attr:`Timeline.start`), and ``args``
carrying the chunk index and bytes.
"""

from __future__ import annotations

import json
from typing import Any

from .._files import check_file_name, write_whole
from .summary import read_spans
from .timeline import Span, Timeline, track_sort_key


def to_chrome(timeline: Timeline, *, name: str = "ringflow") -> dict[str, Any]:
    spans = timeline.spans()
    t0 = timeline.start
    tracks = sorted({s.track for s in spans}, key=track_sort_key)
    tid = {t: i + 1 for i, t in enumerate(tracks)}
    events: list[dict[str, Any]] = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": name}}]
    for track, i in tid.items():
        events.append({"ph": "M", "pid": 1, "tid": i, "name": "thread_name", "args": {"name": track}})
        events.append({"ph": "M", "pid": 1, "tid": i, "name": "thread_sort_index", "args": {"sort_index": i}})
    for s in sorted(spans, key=lambda s: (s.start, tid[s.track])):
        args = dict(s.args)
        if s.chunk is not None:
            args["chunk"] = s.chunk
        events.append({"ph": "X", "pid": 1, "tid": tid[s.track], "name": s.name if s.chunk is None else
                       f"{s.name} #{s.chunk}", "cat": s.name, "ts": (s.start - t0) * 1e6,
                       "dur": max(0.0, s.end - s.start) * 1e6, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": timeline.meta}


def save_chrome(timeline: Timeline, path: str, **kw: Any) -> str:
    """Write ``timeline`` as Chrome trace JSON to the file ``path``; returns ``path``.

    Raises:
        TypeError: ``path`` is not a file name (:func:`check_file_name`).
        OSError: the file cannot be written, or is a device, pipe or socket.
    """
    check_file_name(path, "save_trace")
    write_whole(path, json.dumps(to_chrome(timeline, **kw)))
    return path


def load_spans(path: str) -> list[Span]:
    """Read the complete events of the Chrome trace at ``path`` back as spans (seconds from its zero),
    each on the track its process's thread is named (:func:`ringflow._trace.summary.read_spans`).

    Raises:
        ValueError: ``path`` is a folder, or a file that is empty, not UTF-8 JSON (a byte order mark
            too many among the reasons), or not shaped like a Chrome trace; the message names the file,
            the first event that is wrong and where a trace comes from.
        OSError: the file cannot be opened (missing, no permission); the error names the file and
            says to give a trace written by :meth:`Report.save_trace`.
    """
    # one reader checks a trace, so that this and ringflow trace refuse a file in the same words
    try:
        return read_spans(path)
    except OSError as exc:
        if exc.filename != path or exc.errno is None:
            raise
        # the OS's words alone say nothing to change; OSError(errno, ...) keeps the subclass (FileNotFoundError)
        raise OSError(exc.errno, f"{exc.strerror}; give a trace JSON written by Report.save_trace or "
                      "ringflow bench --trace", path) from None
