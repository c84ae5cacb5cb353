"""Hostile and friendly values for every option of the public entry points, and one way to call
each front door (``stream_map``, ``MapJob``, ``Pipeline``) on each whole-array engine, so a test
can compare how they answer the same input."""

from __future__ import annotations

import gc
import re
from typing import Any, Callable, Optional

import numpy as np

import ringflow as rf
from ringflow import SlotCounts

NAN, INF = float("nan"), float("inf")

# Options each front door takes (host and engine only where whole arrays are moved).
WHOLE_ARRAY_OPTIONS = ("chunk_bytes", "workers", "pinned_budget", "slots", "on_error", "host", "engine",
                       "inplace", "checked")
DOOR_OPTIONS = {
    "stream_map": WHOLE_ARRAY_OPTIONS + ("profile", "keep_warm"),
    "MapJob": WHOLE_ARRAY_OPTIONS,
    "Pipeline": ("chunk_bytes", "workers", "max_in_flight", "pinned_budget", "slots", "on_error", "inplace",
                 "checked", "ordered", "profile"),
}
ALL_OPTIONS = tuple(sorted({name for names in DOOR_OPTIONS.values() for name in names}))

# The whole-array engine settings: staging always runs on the scheduler; registered memory runs
# on either engine.
ENGINE_SETTINGS = {
    "stage": {"host": "stage"},
    "register-direct": {"host": "register", "engine": "direct"},
    "register-pipeline": {"host": "register", "engine": "pipeline"},
}

BAD: dict[str, list] = {
    "chunk_bytes": [0, -1, NAN, INF, 1.5, 10 ** 30, "abc", "", True, [8], "8 parsecs", np.float64(NAN), "1e400",
                    {"bytes": 8}],
    "workers": [0, -1, 1.5, "2", True, 10 ** 9, 2.0, "two"],
    "max_in_flight": [0, -1, NAN, True, "4", INF, 10 ** 18, 2 ** 63],
    "pinned_budget": [-1, 0, NAN, "x", True, 1.5, INF],
    # (a SlotCounts of too many slots cannot be made: tests/test_plan.py refuses it when made)
    "slots": [0, -1, 1.5, "2", True, 10 ** 9, [2]],
    "on_error": ["ignore", None, 1, "RAISE"],
    "host": ["bogus", None, "STAGE", 1],
    "engine": ["bogus", None, "Direct", 0],
    "inplace": ["yes", 1, None],
    "checked": [1, "False", None],
    "ordered": ["no", 0],
    "profile": [1, "yes"],
    "keep_warm": [1, None],
}

# Friendly values that never conflict with one another on a small float32 array (pinned budgets
# large enough for any slot count here; Pipeline chunks large enough for its items).
GOOD: dict[str, list] = {
    "chunk_bytes": [64, 256, 8192, 8192.0, "8KiB", np.int64(256), "1KiB"],
    "workers": [None, 1, 2, np.int64(3)],
    "max_in_flight": [None, 1, 3],
    "pinned_budget": [None, 64 << 20, "64MiB"],
    "slots": [None, 1, 2, 3, SlotCounts(2, 2, 2, 2), SlotCounts(1, 2, 0, 1)],
    "on_error": ["raise", "continue"],
    "host": ["auto", "stage", "register"],
    "engine": ["auto", "direct", "pipeline"],
    "inplace": [False, True, np.True_],
    "checked": [False, True],
    "ordered": [True, False],
    "profile": [False, True],
    "keep_warm": [True, False],
}
GOOD_WHOLE_ARRAY_CHUNKS = GOOD["chunk_bytes"] + [None, "auto", 1 << 30]

PIPELINE_CHUNK = 1024  # bytes per slot when a Pipeline test gives none (the default is 8 MiB)


def compute(x, y):
    """The compute of every test here: y = 2x + 1 (keeps NaN and inf)."""
    y[...] = x * 2 + 1


def expected(x: np.ndarray) -> np.ndarray:
    return x * 2 + 1


def named(message: str) -> set:
    """The option names a message mentions (as whole words; ``slots.host_in`` names slots)."""
    return {name for name in ALL_OPTIONS + ("x", "out", "x_buffer", "out_buffer", "timeout")
            if re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message)}


def settle(dev) -> int:
    """Release what ringflow keeps between calls (warm engines) and what only the garbage
    collector frees (events referenced from tracebacks); returns ``dev.live().total`` plus the
    buffers and streams the collector had to release (ringflow closes all of its own)."""
    rf.drop_warm_pipelines()
    gc.collect()
    return dev.live().total + unclosed(dev)


def unclosed(dev) -> int:
    """The buffers and streams a simulated ``dev`` released because the collector took them
    while still open (0 on devices that do not count them)."""
    counts = getattr(dev, "collected_unclosed", None)
    return sum(counts().values()) if counts is not None else 0


def call(door: str, dev, x: np.ndarray, out: Optional[np.ndarray] = None, *, f: Callable = compute,
         **options: Any) -> Any:
    """Run ``f`` over ``x`` through ``door`` with ``options``; returns the result (``out`` for a
    whole array; for a Pipeline fed ``x`` in four pieces, its results joined in input order)."""
    if door == "stream_map":
        return rf.stream_map(f, x, out, device=dev, **options)
    if door == "MapJob":
        profile = options.pop("profile", False)
        with rf.MapJob(f, x, out, device=dev, **options) as job:
            return job(profile=profile)
    if door == "Pipeline":
        options.setdefault("chunk_bytes", PIPELINE_CHUNK)
        items = [np.ascontiguousarray(part) for part in np.array_split(x, min(4, len(x)))]
        with rf.Pipeline(f, device=dev, **options) as pipe:
            results = list(pipe.map(items))
        if options.get("ordered", True) is False:  # unordered: put them back in input order
            by_bytes = {r.tobytes(): r for r in results}
            results = [by_bytes[expected(item).tobytes()] for item in items]
        return np.concatenate(results)
    raise ValueError(door)


def outcome(fn: Callable[[], Any]) -> tuple:
    """``("ok", result)`` or ``(exception type, names the message mentions, message)``."""
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the test compares what each door raised
        return (type(exc), frozenset(named(str(exc))), str(exc))


