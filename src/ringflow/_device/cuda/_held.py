"""The driver calls a pipeline makes for every chunk, made without letting go of the GIL.

cuda.bindings (and cuda.core above it) releases the GIL around every driver call. For a call
that takes microseconds that is a loss whenever another Python thread is running: the calling
thread must then take the GIL back, and CPython hands it back only when the other thread blocks
or its switch interval (5 ms by default) runs out. A pipeline's progress thread copies, launches
and records events for every chunk while user threads submit and CPU workers run, so each of
those calls could cost it a whole switch interval. See docs/design.md, "Driver calls that keep
the GIL", for the measurement.

The calls here go to the same libcuda entry points through :class:`ctypes.PyDLL`, which keeps
the GIL for the call's duration. Each returns as soon as the work is enqueued: copies only ever
move pinned, registered or device memory (never pageable memory, which the driver copies
synchronously), and nothing a pipeline enqueues needs the GIL to complete (no host callbacks),
so holding it never waits on the GPU. Where libcuda cannot be loaded this way, :func:`calls`
is None and the backend uses cuda.bindings as before.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Optional, Sequence

import numpy as np

from ._lib import check, driver

_U64, _P = ctypes.c_uint64, ctypes.c_void_p


@functools.lru_cache(maxsize=None)
def calls() -> Optional[ctypes.PyDLL]:
    """libcuda with the argument types of the calls below, or None where it cannot be loaded."""
    try:
        lib = ctypes.PyDLL("libcuda.so.1")
        lib.cuMemcpyAsync.argtypes = [_U64, _U64, ctypes.c_size_t, _P]
        lib.cuEventRecord.argtypes = [_P, _P]
        lib.cuLaunchKernel.argtypes = [_P, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                       ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, _P, _P, _P]
    except (OSError, AttributeError):
        return None
    for fn in (lib.cuMemcpyAsync, lib.cuEventRecord, lib.cuLaunchKernel):
        fn.restype = ctypes.c_int
    return lib


def _checked(rc: int, what: Any) -> None:
    if rc:
        check(driver().CUresult(rc), what)


def copy(lib: ctypes.PyDLL, dst: int, src: int, nbytes: int, stream: int, what: Any) -> None:
    """``cuMemcpyAsync`` of ``nbytes`` from address ``src`` to ``dst`` on ``stream`` (handles as
    ints). Raises DeviceError naming ``what`` (text or a callable making it) on failure."""
    _checked(lib.cuMemcpyAsync(dst, src, nbytes, stream), what)


def record(lib: ctypes.PyDLL, event: int, stream: int, what: Any) -> None:
    """``cuEventRecord`` of ``event`` on ``stream``; raises DeviceError naming ``what``."""
    _checked(lib.cuEventRecord(event, stream), what)


def launch(lib: ctypes.PyDLL, function: int, grid: int, block: int, stream: int, args: Sequence[Any],
           what: Any) -> None:
    """``cuLaunchKernel`` of ``function`` on a 1-D ``grid`` of ``block`` threads; ``args``: device
    addresses (ints, passed as 64-bit pointers) and numpy scalars (passed by their bytes).
    Raises DeviceError naming ``what``."""
    held = [(ctypes.c_char * a.nbytes).from_buffer_copy(a.tobytes()) if isinstance(a, np.generic) else _U64(a)
            for a in args]
    params = (_P * len(held))(*[ctypes.addressof(h) for h in held])
    _checked(lib.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, 0, stream, params, None), what)
