"""``ringflow trace FILE``: what a saved trace says, without opening a browser.

The trace is a Chrome/Perfetto JSON as :meth:`Report.save_trace` writes it: one track (thread)
per stage, stream or stall lane, each span a complete event (``ph: "X"``). Spans of one name
that overlap in time sit on numbered tracks (``cpu: prepare``, ``cpu: prepare [1]``, ...), so
the number of tracks a name uses is how many of its spans ran at once at most. In a trace whose
spans overlap on one track (nested spans, another writer's trace) the most that ran at once
count as its tracks.
"""

from __future__ import annotations

import collections
import json
import math
import os
import sys
from typing import Any

import numpy as np

from .. import _jsontext as jsontext
from .._files import is_special, printable, too_large
from .timeline import STAGES, Span

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


def read_spans(path: str) -> list[Span]:
    """The complete events of the Chrome trace at ``path`` as spans (seconds from its zero).

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
        with open(path, encoding="utf-8") as fh:
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
        raise _fail(path, f"'traceEvents' must be a list of events, got {type(events).__name__}")
    names: dict[Any, str] = {}
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise _fail(path, f"event {i} is not a JSON object (got {type(e).__name__})")
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            args = e.get("args")
            if not isinstance(args, dict) or not isinstance(args.get("name"), str):
                raise _fail(path, f"event {i} (a thread_name) has no args.name string")
            names[_key(e.get("tid"))] = args["name"]
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
        tid = _key(e.get("tid"))
        start = ts / 1e6
        out.append(Span(names.get(tid, str(e.get("tid"))), name, start, start + dur / 1e6, chunk, args))
    return out


def _key(tid: Any) -> Any:
    return tid if isinstance(tid, (int, str, float, type(None))) else json.dumps(tid, sort_keys=True)


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
    spans = read_spans(path)
    out: dict[str, Any] = {"file": path, "spans": len(spans), "chunks": 0, "wall_ms": 0.0, "stages": {},
                           "legend": dict(LEGEND)}
    if not spans:
        return out
    start = min(s.start for s in spans)
    end = max(s.end for s in spans)
    wall = end - start
    by_name: dict[str, list[Span]] = collections.defaultdict(list)
    for s in spans:
        by_name[s.name].append(s)
    out["chunks"] = len({s.chunk for s in spans if s.chunk is not None and s.name in STAGES})
    out["wall_ms"] = wall * 1e3
    order = {s: i for i, s in enumerate(STAGES)}
    for name, group in sorted(by_name.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])):
        d = np.array([g.end - g.start for g in group])
        # ringflow gives each of the spans that overlap a lane of its own; spans nested or
        # overlapping on one thread (another writer's trace) count as the most that ran at once,
        # so that total / (tracks x wall) stays a load of at most 1
        tracks = max(len({g.track for g in group}), _most_at_once(group))
        total = float(d.sum())
        out["stages"][name] = {
            "count": len(group), "tracks": tracks, "median_ms": float(np.median(d)) * 1e3, "total_ms": total * 1e3,
            "busy_fraction": _union(group) / wall if wall > 0 else 0.0,
            "per_track_fraction": total / (tracks * wall) if wall > 0 else 0.0}
    gpu = [s for s in spans if s.name in ("h2d", "compute", "d2h")]
    if gpu:
        union = _union(gpu)
        out["gpu_busy_union_ms"] = union * 1e3
        out["gpu_overlap"] = sum(s.end - s.start for s in gpu) / union if union > 0 else 1.0
    return out


def _rounded(obj: Any) -> Any:
    """Floats to 6 significant digits: a clock's last bits are noise, not information."""
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    return obj


def _most_at_once(spans) -> int:
    """The most of ``spans`` that run at any one time (one that ends as another starts does not
    overlap it)."""
    if not spans:
        return 0
    times = np.array([s.start for s in spans] + [s.end for s in spans])
    steps = np.repeat(np.array([1, -1], dtype=np.int64), len(spans))
    order = np.lexsort((steps, times))  # by time, an end (-1) before a start (+1) at the same time
    return int(max(0, np.cumsum(steps[order]).max()))


def _union(spans) -> float:
    total, cur_a, cur_b = 0.0, None, None
    for s in sorted(spans, key=lambda s: s.start):
        if cur_b is None or s.start > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = s.start, s.end
        else:
            cur_b = max(cur_b, s.end)
    return total + ((cur_b - cur_a) if cur_b is not None else 0.0)


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
