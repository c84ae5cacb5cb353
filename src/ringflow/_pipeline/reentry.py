"""Calls a pipeline cannot serve: from inside its own stages, and in a child forked from its process.

**From inside its own stages.** A stage (``prepare``, ``compute``, ``consume``,
``item_nbytes``) runs while the pipeline waits for it: the chunk cannot move on until the
stage returns. A call made from inside it that waits for the pipeline (``submit`` on a full
pipeline, ``map``, ``cancel``, ``close``, the result of a chunk not yet ended, cancelling a
chunk) would wait for the very stage it runs in, forever on a real GPU; and a stage run by the
progress thread (``compute``, on every device; every stage, on the simulated GPU) that drove the
pipeline from inside it would change the scheduler's state in the middle of a step. So the
pipeline marks the thread while one of its stages runs (a thread-local, set and reset around
the user's call), and those calls refuse, naming the call and the stage. Calls that only read
(``stats``, ``failures``, ``report``, the result of a chunk already ended) stay allowed, and
another pipeline may be used as usual; a future's done-callback is not a stage (it runs once
its chunk has ended) and may call anything that waits by blocking (its wait drives the pipeline
there). It cannot await the pipeline on an event loop of its own (``asyncio.run`` of
``asubmit``/``amap`` in the callback): the await ends only once the progress thread sets a
future, and that thread is the one running the loop, so those calls refuse there.

**After fork().** A pipeline's progress thread and worker threads exist only in the process
that made them: in a child forked from it they are gone, so every wait would last forever (and
CUDA cannot be used in a child forked after it was initialised). A handler registered with
:func:`os.register_at_fork` counts forks in the child; a pipeline made before the count last
changed refuses every call, and ``close()`` forgets it without touching what belongs to the
parent.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Any, Callable

_here = threading.local()  # .stage: (the scheduler whose stage runs on this thread, its name), or None

_forks = 0  # forks this process went through as the child


def _forked() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork()
    os.register_at_fork(after_in_child=_forked)


def generation() -> int:
    """How many forks this process is removed from the one that started it (0 in that one)."""
    return _forks


def check_process(made_in: int, what: str = "Pipeline") -> None:
    """Refuse a call on an object made in the process a fork copied this one from.

    Raises:
        RuntimeError: ``made_in`` (its :func:`generation` when made) is not this process's.
    """
    if made_in != _forks:
        raise RuntimeError(
            f"this {what} was made in a parent process before fork(); its progress thread, workers and "
            f"device state are not in this child process. Create a new {what} in the child (and start "
            "children with the 'spawn' or 'forkserver' method where the parent has used CUDA)")


_calls = itertools.count()  # numbers every stage call (next() on a count is atomic in CPython)


class StageOwner:
    """Whose stages a thread runs: a pipeline's scheduler marks its stages with one of these,
    which refers to nothing, so a marked callable it keeps makes no cycle through it.
    :attr:`running` maps the number of each of its stage calls running now, on any thread, and
    of each done-callback of its futures running now (:func:`run_counted`), to what it runs:
    (the stage, or ``"done-callback"``; the item's index, or None where the call does not know
    it; :func:`time.monotonic` as it began)."""

    __slots__ = ("__weakref__", "running")

    def __init__(self) -> None:
        self.running: dict = {}


def run_stage(owner: Any, stage: str, fn: Callable, *args: Any, index: "int | None" = None) -> Any:
    """``fn(*args)`` with this thread marked as running ``owner``'s stage ``stage`` (within any
    stage it already runs: a compute that runs a whole-array call of its own), and the call
    counted in ``owner.running`` (for the item ``index``) where the owner keeps that map."""
    outer = getattr(_here, "stage", None)
    _here.stage = (owner, stage, outer)
    # another thread asks which calls run (an interrupted close: stalled_stage_calls; an ending
    # that waits: driver.warn_if_stalled); a dict's item set and pop need no lock of ours
    running = getattr(owner, "running", None)
    call = next(_calls)
    if running is not None:
        running[call] = (stage, index, time.monotonic())
    try:
        return fn(*args)
    finally:
        _here.stage = outer
        if running is not None:
            running.pop(call, None)


def run_counted(owner: Any, fn: Callable, *args: Any, index: "int | None" = None) -> Any:
    """``fn(*args)`` counted in ``owner.running`` as a stage call is (as a ``"done-callback"``
    of the item ``index``), without marking the thread as running a stage: for a done-callback
    of the owner's futures, which may call the pipeline (it is no stage), but which the thread
    running it, like a stage, cannot be made to leave."""
    # (run_stage counts the same way inline: it runs for every stage call, and a call into this
    # would add to each)
    running = getattr(owner, "running", None)
    if running is None:
        return fn(*args)
    call = next(_calls)
    running[call] = ("done-callback", index, time.monotonic())
    try:
        return fn(*args)
    finally:
        running.pop(call, None)


def stalled_stage_calls(owner: Any, seen: "set | None") -> "tuple[set, bool]":
    """The stage calls (and done-callbacks, :func:`run_counted`) of ``owner`` running now, and
    whether one of them was running already when ``seen`` (what an earlier call returned) was
    taken: it has run ever since."""
    now = set(getattr(owner, "running", ()))  # (the keys, copied in C: no other thread changes them meanwhile)
    return now, bool(seen) and not now.isdisjoint(seen)


def marked(owner: Any, stage: str, fn: Callable) -> Callable:
    """``fn`` that runs as :func:`run_stage` does, keeping its name (traces show it) and the
    attributes the pipeline reads from a compute (its simulated duration, whether it is
    pointwise, a kernel's fast launch path)."""
    def run(*args: Any) -> Any:
        return run_stage(owner, stage, fn, *args)

    run.__name__ = getattr(fn, "__name__", type(fn).__name__)
    run.__qualname__ = getattr(fn, "__qualname__", run.__name__)
    for name in ("sim_seconds", "pointwise", "__ringflow_launch__", "_ringflow_writes_into_y"):
        if hasattr(fn, name):
            setattr(run, name, getattr(fn, name))
    return run


def running_stage_of(owner: Any) -> "str | None":
    """The stage of ``owner``'s that this thread runs (innermost first), or None."""
    stage = getattr(_here, "stage", None)
    while stage is not None:
        if stage[0] is owner:
            return stage[1]
        stage = stage[2]
    return None


def refuse_from_stage(owner: Any, call: str, kind: str = "pipeline") -> None:
    """Refuse ``call``, a call that waits for ``owner`` (a pipeline scheduler's
    :class:`StageOwner`, or a whole-array job's token), on a thread running one of its stages.

    Raises:
        RuntimeError: naming the call and the stage.
    """
    if getattr(_here, "stage", None) is None:
        return
    stage = running_stage_of(owner)
    if stage is not None:
        raise RuntimeError(
            f"{call} was called from inside this {kind}'s own {stage}: it waits for the {kind}, which "
            f"waits for that {stage} to return, so it would wait for itself. Call it from another thread "
            "once the stage has returned, or from a future's done-callback")


def on_progress_thread(driver: Any) -> bool:
    """Whether the calling thread is ``driver``'s progress thread (in one of its done-callbacks)."""
    return getattr(driver, "thread", None) is threading.current_thread()


def refuse_on_progress_thread(driver: Any, call: str) -> None:
    """Refuse ``call``, an asyncio call (``asubmit``, ``amap``), on ``driver``'s progress thread:
    an event loop run there (in a future's done-callback) awaits futures only that thread sets.

    Raises:
        RuntimeError: naming the call and what to do instead.
    """
    if on_progress_thread(driver):
        raise RuntimeError(
            f"{call} was called on an event loop running on this pipeline's own progress thread (in a future's "
            "done-callback): the await ends only once that thread sets the chunk's future, and it is running "
            "the loop, so it would wait for itself. In a done-callback call submit(...).result() instead (it "
            "drives the pipeline while it waits), or hand the coroutine to a loop on another thread "
            "(asyncio.run_coroutine_threadsafe)")
