"""Timing helpers over the device protocol (any backend): events around enqueued work."""

from __future__ import annotations

from typing import Callable

from .protocol import Stream


def time_events(stream: Stream, enqueue: Callable[[], None], warmup: int, repeats: int) -> list[float]:
    """Seconds between timing events around ``enqueue()`` on one stream, each repeat synced."""
    for _ in range(warmup):
        enqueue()
    stream.sync()
    times = []
    for _ in range(repeats):
        e0 = stream.record(timing=True)
        enqueue()
        e1 = stream.record(timing=True)
        e1.sync()
        times.append(e1.elapsed_since(e0))
    return times
