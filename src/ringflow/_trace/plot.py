"""A Gantt chart of one run: a row per stage track, a bar per chunk, stalls in grey.

Drawn on a ``matplotlib.figure.Figure`` made here, or on the caller's ``Axes``: pyplot is never
imported and the backend never switched, so a notebook's inline plots keep working."""

from __future__ import annotations

import io
import os
import shutil
from typing import Optional

from .._files import check_file_name, write_whole
from .timeline import Timeline, track_sort_key

COLOURS = {"prepare": "#4c72b0", "h2d": "#dd8452", "compute": "#55a868", "d2h": "#c44e52", "consume": "#8172b3"}


def plot_gantt(timeline: Timeline, path: Optional[str] = None, *, ax=None, title: str = ""):
    """Draw ``timeline`` (see :meth:`ringflow.Report.plot`); returns the Figure drawn on.

    Raises RuntimeError without matplotlib, TypeError when ``ax`` is not a matplotlib Axes or
    ``path`` neither None, a file name nor an open file, ValueError when ``path`` names a file
    type matplotlib cannot write (:func:`plot_format`)."""
    if path is not None:
        check_file_name(path, "plot", file_objects=True)
    try:
        from matplotlib.axes import Axes
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("report.plot needs matplotlib: pip install 'ringflow[plot]'") from exc
    file_type = plot_format(path, "plot") if path is not None else None
    # stage tracks split into lanes (one per worker); stalls drawn as one row per kind
    spans = [s for s in timeline.spans() if not s.track.startswith("stall")]
    spans += [s for s in timeline.spans(lanes=False) if s.track.startswith("stall")]
    rows = sorted({s.track for s in spans}, key=track_sort_key)
    if ax is None:
        fig = Figure(figsize=(12, 0.6 * len(rows) + 1.5), dpi=110)
        ax = fig.add_subplot()
        own = True
    elif isinstance(ax, Axes):
        fig = ax.figure
        while getattr(fig, "figure", fig) is not fig:  # a subfigure's axes: save the whole figure
            fig = fig.figure
        own = False
    else:
        raise TypeError(f"plot(ax=...) takes a matplotlib Axes to draw into, or None for a new figure; "
                        f"got {type(ax).__name__}")
    t0 = timeline.start
    y = {r: len(rows) - 1 - i for i, r in enumerate(rows)}
    for s in spans:
        colour = COLOURS.get(s.name, "#b0b0b0")
        ax.barh(y[s.track], (s.end - s.start) * 1e3, left=(s.start - t0) * 1e3, height=0.7, color=colour,
                edgecolor="white", linewidth=0.3)
    ax.set_yticks(list(y.values()), list(y.keys()))
    ax.set_xlabel("ms since the first chunk was accepted")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    if own:  # the caller's figure keeps the layout the caller gave it
        fig.tight_layout()
    if path is not None:
        save_figure(fig, path, file_type)
    return fig


def plot_format(path, where: str) -> str:
    """The file type a chart saved to ``path`` (a file name or an open file) is written in: its
    name's extension, lower-case, or ``"png"`` where the name has none or an open file has no name.

    Raises:
        ValueError: matplotlib cannot write that type (or, for ``.pgf``, LaTeX is not
            installed); the message starts with ``where`` and says what to name the file.
    """
    from matplotlib.backend_bases import FigureCanvasBase

    if not hasattr(path, "write"):
        path = os.fsdecode(path)
    name = getattr(path, "name", path)  # an open file's name, an int where opened from a descriptor
    ext = os.path.splitext(name)[1].lstrip(".").lower() if isinstance(name, str) else ""
    if not ext:
        return "png"
    supported = FigureCanvasBase.get_supported_filetypes()
    if ext not in supported:
        raise ValueError(f"{where}: matplotlib cannot write .{ext} files (path {name!r}); end the name with one of "
                         f"{', '.join('.' + e for e in sorted(supported))}, or with none for a PNG")
    if ext == "pgf":  # written through LaTeX, which matplotlib finds missing only once the chart is drawn
        from matplotlib import rcParams

        tex = rcParams["pgf.texsystem"]
        if shutil.which(tex) is None:
            raise ValueError(f"{where}: .pgf files need {tex} (LaTeX), which is not installed; name the file "
                             ".png, .svg or .pdf")
    return ext


def save_figure(fig, path, file_type: str) -> None:
    """Write ``fig`` to the file ``path`` itself (a file name, or an open binary file), as
    ``file_type``: what :func:`plot_format` said of ``path`` before the chart was drawn (the
    name's extension; PNG where it has none, since matplotlib would otherwise write ``path +
    ".png"``, a file nobody asked for, or where an open file has no name).

    A file name is written whole, as every file ringflow writes (:func:`write_whole`): drawn into
    memory first, then moved into place, so that a pipe or a device is refused (an SVG drawn
    into a pipe waited for ever for a reader) and a failed write leaves the file as it was.
    """
    if not hasattr(path, "write"):
        path = os.fsdecode(path)
    if isinstance(path, str):
        drawn = io.BytesIO()
        fig.savefig(drawn, format=file_type)
        write_whole(path, drawn.getvalue())
    else:
        fig.savefig(path, format=file_type)
