"""Failures kept, or raised, without keeping a failed chunk's frames alive.

On the simulated GPU a stage runs inside whatever call advanced virtual time (a scheduler step,
an enqueue, a wait), so its exception's traceback reaches those callers through ``f_back``; once
they have returned, their locals (chunks, slots, events) stay alive as long as the traceback
does. Where one of those is what keeps the exception (a failed event holds its launch's error),
the two form a reference cycle that only the cyclic collector frees.

:func:`forget_frames`, for a failure kept for inspection, clears the locals of every frame of its
traceback (but a generator's or coroutine's, which clearing would close) and of ringflow's
callers of them that have returned; :func:`forget_callers`, for a failure about to reach the
caller, clears only those callers, leaving the traceback's own frames (the user's compute among
them) as they are. :func:`forget_own_frames`, for a failure an engine
raises to its caller, clears those callers and the traceback's own frames that are ringflow's,
so the failure keeps the user's frames but not the engine, its buffers or the call's arrays.
None touches a frame still running, nor a caller outside ringflow.

On the simulated GPU the call that advanced virtual time may be another thread's (a caller's
staging copy, a caller's wait): its frames return only once that thread's call does, which may
be after every later step of the progress thread. :func:`forget_frames` says when it stopped at
such a frame, so the scheduler looks again until that thread has returned (a frame of the
calling thread's own stack, such as the progress thread's loop, never returns while it looks).
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Optional

_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
_OWN_CODE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # ringflow's package


def forget_frames(exc: BaseException) -> bool:
    """Clear the local variables of the frames ``exc``'s traceback passes through (its causes'
    too), and of the finished frames that called them: a failure kept for inspection then keeps
    its message and traceback lines but not the chunk, its input or its events alive.

    Returns:
        True where a caller of those frames is still running on another thread: its frames
        (and their locals) are left, to be cleared by a later call once that thread's call has
        returned; False where nothing is left that a later call could clear.
    """
    pending = False
    for one in _chain(exc):
        tb = one.__traceback__
        _clear_finished(tb)
        pending = _forget_callers_of(tb) or pending
    return pending


def _clear_finished(tb) -> None:
    """Clear the locals of each frame of ``tb`` (as :func:`traceback.clear_frames`) but a
    generator's or coroutine's: the failure may have been raised on through one that caught it
    and goes on (a map skipping an interrupted item), and clearing a suspended one's frame would
    close it."""
    while tb is not None:
        if not tb.tb_frame.f_code.co_flags & _SUSPENDABLE:
            try:
                tb.tb_frame.clear()
            except RuntimeError:  # still running
                pass
        tb = tb.tb_next


def forget_callers(exc: BaseException) -> None:
    """Clear only the locals of ringflow's finished frames that called the frames of ``exc``'s
    traceback (its causes' too), leaving the traceback's own frames as they are: for a failure
    about to be raised to the caller, whose frames (the user's compute among them) are theirs to
    look at."""
    for one in _chain(exc):
        _forget_callers_of(one.__traceback__)


def forget_own_frames(exc: BaseException) -> None:
    """Clear the locals of ringflow's finished frames in ``exc``'s traceback (its causes' too)
    and of ringflow's finished frames that called them, leaving the user's frames (the compute
    among them) as they are: for a failure about to be raised to the caller, which then keeps
    the user's frames and the lines that raised, but not the engine or the arrays of the call."""
    for one in _chain(exc):
        tb = one.__traceback__
        _forget_callers_of(tb)
        while tb is not None:
            if _is_own(tb.tb_frame):
                try:
                    tb.tb_frame.clear()
                except RuntimeError:  # still running
                    pass
            tb = tb.tb_next


def _is_own(frame) -> bool:
    """Whether ``frame`` is ringflow's and may be cleared (not a suspended generator's or
    coroutine's, which clearing would close)."""
    return not frame.f_code.co_flags & _SUSPENDABLE and frame.f_code.co_filename.startswith(_OWN_CODE)


def _chain(exc: Optional[BaseException]):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _forget_callers_of(tb) -> bool:
    """:func:`_forget_callers` for each frame of ``tb``; True where one stopped at another thread's."""
    pending = False
    while tb is not None:
        pending = _forget_callers(tb.tb_frame) or pending
        tb = tb.tb_next
    return pending


def _forget_callers(frame) -> bool:
    """Clear the locals of ringflow's frames that called ``frame`` and have returned since. A
    traceback's frames keep their callers alive (``f_back``); on the simulated GPU a host task or
    kernel runs inside whatever scheduler call advanced virtual time, so those callers hold other
    chunks, slots and events. Stops at the first caller still running, outside ringflow (the
    user's frames are the user's), or of a generator or coroutine (clearing a suspended one would
    close it). Returns True where it stopped at a caller running on another thread."""
    f = frame.f_back
    while f is not None and _is_own(f):
        try:
            f.clear()
        except RuntimeError:  # still running: so are its callers
            return not _on_this_thread(f)
        f = f.f_back
    return False


def _on_this_thread(frame) -> bool:
    """Whether ``frame`` is on the calling thread's stack (a running frame that is not, is another
    thread's)."""
    f = sys._getframe(1)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False
