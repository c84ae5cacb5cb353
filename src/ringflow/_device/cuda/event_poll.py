"""Polling CUDA events without holding the GIL.

Why: a thread that waits for the GPU by querying events in Python, with a yield between
queries, lets go of the GIL and takes it straight back at every yield. A thread that needs the
GIL meanwhile (one back from a copy or a lock wait) is woken each time but finds the GIL taken
again, and CPython hands it over only after the switch interval (5 ms by default). So a
pipeline's progress thread, polling for its next completion, held up the thread submitting to
it by up to 5 ms at a time (docs/design.md, "Driver calls and the GIL"). Here the whole poll is
one call through :mod:`ctypes` (which lets go of the GIL once, for the call): a few lines of C
(built once per machine, :mod:`..native_build`) query ``cuEventQuery`` in a loop until an event
is no longer pending, a wake word is set, or the time is up.

Where no compiler works, ``libcuda`` has no ``cuEventQuery`` or ``RINGFLOW_NATIVE_POLL=0`` is
set, :func:`poller` returns None and the device polls in Python as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from typing import Optional, Sequence

from .. import native_build

log = logging.getLogger(__name__)

NOT_READY = 600  # CUDA_ERROR_NOT_READY: what cuEventQuery returns for a pending event

_SOURCE = r"""
#include <sched.h>
#include <time.h>

typedef int (*query_fn)(void *);

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Query each of n events with `query` until one returns something other than `not_ready`
   (complete, or an error: the caller asks again to tell which), *wake is non-zero, or
   timeout_ns nanoseconds pass. Returns that event's index, -1 for the wake word, -2 for the
   timeout. Between rounds the thread yields its core to any thread that wants it. */
int ringflow_poll_events(query_fn query, void **events, int n, int not_ready,
                         volatile int *wake, long long timeout_ns) {
    long long end = now_ns() + timeout_ns;
    for (unsigned long k = 0;; k++) {
        for (int i = 0; i < n; i++)
            if (query(events[i]) != not_ready) return i;
        if (*wake) return -1;
        if ((k & 7) == 7 && now_ns() >= end) return -2;
        sched_yield();
    }
}
"""


class EventPoller:
    """One native poll over CUDA event handles (see the module's doc)."""

    def __init__(self, lib: ctypes.CDLL, query: int):
        self._fn = lib.ringflow_poll_events
        self._query = query
        self._never = ctypes.c_int(0)  # the wake word of a poll that has none

    def poll(self, handles: Sequence[int], timeout: float, wake: Optional[ctypes.c_int] = None) -> int:
        """Query the events ``handles`` (``CUevent`` values) until one is no longer pending,
        ``wake`` (an int another thread sets) is non-zero, or ``timeout`` seconds pass; the
        calling thread holds no GIL meanwhile. The calling thread must have the events' context
        current. Returns the index of that event, -1 (woken) or -2 (timed out)."""
        n = len(handles)
        events = (ctypes.c_void_p * n)(*handles)
        word = self._never if wake is None else wake
        return self._fn(self._query, events, n, NOT_READY, ctypes.byref(word), int(max(0.0, timeout) * 1e9))


_lock = threading.Lock()
_loaded: "Optional[EventPoller] | bool" = None  # None: not tried yet; False: unavailable


def poller() -> Optional[EventPoller]:
    """The native event poller, building it on first use; None where it cannot be had (logged
    once)."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _load()
    return _loaded or None


def library() -> ctypes.CDLL:
    """The poll's library, built on first use. Raises as :func:`~..native_build.load` does."""
    lib = native_build.load("event_poll", _SOURCE)
    lib.ringflow_poll_events.argtypes = (ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                         ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_longlong)
    lib.ringflow_poll_events.restype = ctypes.c_int
    return lib


def _load() -> "EventPoller | bool":
    if os.environ.get("RINGFLOW_NATIVE_POLL", "1") == "0" or not sys.platform.startswith("linux"):
        log.info("native event polls off: polling events in Python")
        return False
    try:
        query = ctypes.cast(ctypes.CDLL("libcuda.so.1").cuEventQuery, ctypes.c_void_p).value
        return EventPoller(library(), query)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the Python poll, which always works
        log.info("native event polls unavailable (%s): polling events in Python", native_build.failure_detail(exc))
        return False
