"""The interface both whole-array engines implement, and the one place that picks between them.

A whole-array job (``stream_map``, ``MapJob``) runs on one of two engines:

* the **direct** engine (:class:`~ringflow._pipeline.direct.DirectSchedule`): where the copy
  engines read ``x`` and write ``out`` in place (pinned or registered memory), every call is a
  sequence of stream operations known in advance, enqueued in one pass with no scheduler;
* the **scheduled** engine (:class:`~ringflow._pipeline.scheduled.ScheduledEngine`): the
  pipeline's scheduler, needed when the CPU works between the copies (staging through pinned
  rings) or when a failed chunk must not stop the others (``on_error="continue"``).

Both are :class:`Engine`\\ s, and :func:`make_engine` is the only code that chooses and builds
one; ``MapJob`` holds one for its life and ``stream_map`` takes one from the warm cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol

import numpy as np

from .._testing import current as current_hooks

ENGINES = ("auto", "direct", "pipeline")


@dataclasses.dataclass(frozen=True)
class Arrays:
    """The arrays of one call: ``x`` and ``out``, and the pinned memory behind them where the copy
    engines use them in place (None when staging). ``pooled``: whether either may be
    :mod:`ringflow.host` pool memory, whose next user a call orders after itself (False: known
    to be neither, so a call leaves no hand-off for them)."""

    x: np.ndarray
    out: np.ndarray
    x_buffer: Any = None
    out_buffer: Any = None
    pooled: bool = True


class Engine(Protocol):
    """What runs a whole-array job, call after call.

    Ordering facts every engine keeps: ``run`` returns only once every operation of the call
    has completed (so the caller may rewrite ``x`` and read ``out``), and once ``run`` raised,
    nothing it enqueued still touches the caller's memory.
    """

    def run(self, arrays: Arrays, *, profile: bool = False) -> None:
        """Run the job over ``arrays``; with ``profile`` keep this call's timeline for
        :meth:`report`.

        Raises:
            StageError: a chunk failed (stage and chunk index named; the original as ``__cause__``).
            DeviceError: the device broke (sticky error).
        """

    def report(self) -> Any:
        """The :class:`~ringflow.Report` of the last profiled call. Raises RuntimeError if none."""

    @property
    def n_chunks(self) -> int:
        """The chunks the next call runs (the last call's, unless that call found the job
        compute-bound and tapered the calls after it)."""

    def chunk_rows(self, index: int) -> Optional[tuple]:
        """The rows ``(start, stop)`` of ``x`` that chunk ``index`` of the last call held (a
        StageError's ``index``), or None for an index the call did not have; also once closed."""

    def fail(self, exc: BaseException) -> None:
        """After ``run`` raised ``exc``: settle everything enqueued and close. Never raises."""

    def park(self) -> bool:
        """Forget the finished call (no reference to its arrays is kept) and say whether the engine
        can serve another call as it is."""

    def held_bytes(self) -> tuple[int, int]:
        """``(pinned, device)``: the bytes of pinned host memory and of device memory the engine
        holds between calls (its rings; the caller's memory used in place is not counted);
        ``(0, 0)`` once closed."""

    def close(self) -> None:
        """Release streams, rings and workers, stream-ordered after all work. Harmless twice;
        never raises."""

    def forget_forked(self) -> None:
        """In a child forked after the engine was made: closed from now on, touching nothing (its
        threads are not in this process; its memory and device state are the parent's), so
        that neither a close nor the collector releases the parent's resources from the child.
        Never raises."""


def why_not_direct(strategy: str, options: dict) -> Optional[str]:
    """Why a whole-array job with this host strategy and these options needs the scheduler, or
    None when the direct engine runs it the same."""
    from .direct import GUARDS

    if strategy == "stage":
        return "host='stage' copies x and out through pinned rings on CPU workers"
    if options.get("on_error", "raise") != "raise":
        return "on_error='continue' completes the other chunks around a failed one"
    guards = sorted(current_hooks().guards_off - set(GUARDS))
    if guards:
        return f"the guard(s) {guards} belong to the scheduler"
    return None


def choose_engine(engine: str, strategy: str, options: dict) -> str:
    """"direct" or "pipeline" for a whole-array job: ``engine="auto"`` picks direct wherever it
    runs the job the same.

    Raises:
        ValueError: an unknown ``engine``, or ``engine="direct"`` where it cannot run the job
            (the message says why).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    reason = why_not_direct(strategy, options)
    if engine == "direct" and reason is not None:
        raise ValueError(f"engine='direct' cannot run this job: {reason}; use engine='pipeline' (or 'auto')")
    return "direct" if engine != "pipeline" and reason is None else "pipeline"


def make_engine(kind: str, f, layout, options: dict, arrays: Arrays, *, bind: bool = False) -> Engine:
    """Build the ``kind`` ("direct" or "pipeline") engine for ``layout`` (a
    :class:`~ringflow._pipeline.whole_array.MapLayout`), ready to run ``arrays``. ``bind``: every
    call will use these same arrays (a ``MapJob``), so their per-chunk views are made once here."""
    if kind == "direct":
        from .direct import DirectSchedule

        return DirectSchedule.for_layout(f, layout, options, arrays if bind else None)
    from .scheduled import ScheduledEngine

    return ScheduledEngine(f, layout, options, arrays)
