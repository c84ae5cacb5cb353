"""A Gantt chart of one run: a row per stage track, a bar per chunk, stalls in grey."""

from __future__ import annotations

from .timeline import Timeline, track_sort_key

COLOURS = {"prepare": "#4c72b0", "h2d": "#dd8452", "compute": "#55a868", "d2h": "#c44e52", "consume": "#8172b3"}


def plot_gantt(timeline: Timeline, path: str, *, title: str = "") -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("report.plot needs matplotlib: pip install 'ringflow[plot]'") from exc
    # stage tracks split into lanes (one per worker); stalls drawn as one row per kind
    spans = [s for s in timeline.spans() if not s.track.startswith("stall")]
    spans += [s for s in timeline.spans(lanes=False) if s.track.startswith("stall")]
    t0 = timeline.start
    rows = sorted({s.track for s in spans}, key=track_sort_key)
    y = {r: len(rows) - 1 - i for i, r in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.5), dpi=110)
    for s in spans:
        colour = COLOURS.get(s.name, "#b0b0b0")
        ax.barh(y[s.track], (s.end - s.start) * 1e3, left=(s.start - t0) * 1e3, height=0.7, color=colour,
                edgecolor="white", linewidth=0.3)
    ax.set_yticks(list(y.values()), list(y.keys()))
    ax.set_xlabel("ms since the first chunk was accepted")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
