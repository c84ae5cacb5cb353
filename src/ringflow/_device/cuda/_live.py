"""Leak accounting: what a device has handed out and not yet released.

Each resource registers itself once; its count drops exactly once, when it is closed or, if
the caller never closed it, when it is garbage-collected (``weakref.finalize`` runs either
way and only once). Open closeable resources are also kept in a weak set so that
``Device.close()`` can close what the caller forgot.

Events are counted apart: a call records one or more per chunk, so each is counted by a token
in :attr:`LiveRegistry.event_tokens`, appended when it is made and popped when it goes. A
list's ``append`` and ``pop`` are each one atomic operation, so the count needs neither a lock
nor a Python-level call per event.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any, Callable

from ..protocol import LiveCounts

KINDS = ("host_buffers", "device_buffers", "streams", "events")


class LiveRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(KINDS, 0)
        self._open: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self.event_tokens: list = []  # one per live event (see the module docstring)

    def track(self, obj: Any, kind: str, cleanup: Callable[[], None] | None = None,
              closeable: bool = True) -> weakref.finalize:
        """Count ``obj`` as live. Calling the returned finalizer (from ``close``) runs
        ``cleanup`` and uncounts it; it also runs by itself if ``obj`` is collected unclosed.
        ``cleanup`` must not refer to ``obj`` (that would keep it alive forever)."""
        with self._lock:
            self._counts[kind] += 1
            if closeable:
                self._open.add(obj)
        fin = weakref.finalize(obj, self._release, kind, cleanup)
        fin.atexit = False  # at interpreter exit the process (and its CUDA context) goes anyway
        return fin

    def forget(self, obj: Any) -> None:
        with self._lock:
            self._open.discard(obj)

    def _release(self, kind: str, cleanup: Callable[[], None] | None) -> None:
        try:
            if cleanup is not None:
                cleanup()
        except Exception as exc:  # noqa: BLE001 - runs at close or collection: never raise
            warnings.warn(f"releasing a CUDA {kind[:-1].replace('_', ' ')} failed: {type(exc).__name__}: {exc}",
                          RuntimeWarning, stacklevel=2)
        finally:
            with self._lock:
                self._counts[kind] -= 1

    def open_objects(self) -> list[Any]:
        with self._lock:
            return list(self._open)

    def counts(self) -> LiveCounts:
        with self._lock:
            return LiveCounts(**{**self._counts, "events": len(self.event_tokens)})
