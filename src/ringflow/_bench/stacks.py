"""Every thread's current frame, without the interpreter's deadlock in reading them.

On CPython 3.11, ``sys._current_frames()`` makes the frame objects it returns while holding the
interpreter's lock on its thread states; making one can start a garbage collection, and an
object the collection frees (a ``threading.local``'s storage) takes that lock again: the call
never returns (python/cpython#106883, fixed from 3.12). The collector is kept off for the call.
"""

from __future__ import annotations

import gc
import sys
from types import FrameType


def current_frames() -> dict[int, FrameType]:
    """``sys._current_frames()`` with the garbage collector off for the call (and back on after,
    if it was on): a thread ident to its current frame, for every thread."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()
