"""Pinned host arrays from a caching pool: ``ringflow.host``.

>>> import numpy as np, ringflow as rf
>>> dev = rf.device("sim")
>>> x = rf.host.empty((1 << 16,), np.float32, device=dev)   # pinned, from dev's pool
>>> x[:] = 1.0
>>> def double(a, b):
...     b[:] = a * 2
>>> y = rf.stream_map(double, x, out=rf.host.empty_like(x))         # on x's device, in place
>>> float(y[0])
2.0

An array from :func:`empty` is a plain ``numpy.ndarray`` over page-locked memory that the
copy engines read and write in place: :func:`ringflow.stream_map` and
:class:`ringflow.MapJob`, given such arrays as ``x`` and ``out``, neither stage nor register
them. When the array and every view of it are garbage-collected, its memory goes back to its
device's pool for the next :func:`empty` of the same size class, never before every device
operation recorded on it (:func:`record_use`) is done. Each device has its own pool; the
default device is ``ringflow.device()``, made once on first use and kept.

Over the budget (:func:`set_budget`), :func:`empty` returns ordinary pageable memory (and says
so once on the ``"ringflow"`` logger) rather than failing. See the pinned-memory guide.

:func:`empty_slot` is for a pipeline's ``prepare``: an array in the pinned slot the item goes to,
which ``prepare`` fills and returns, so the stage copies nothing.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Optional, Sequence

import numpy as np

from ._checks import check_flag
from ._device.host_pool import (HostPool, HostPoolStats, block_buffer_taken_in, check_shape_dtype, owner_of, pool_for,
                                 set_default_budget)
from ._device.protocol import Device, HostBuffer
from ._pipeline.slot_array import empty_slot

__all__ = ["empty", "empty_like", "empty_slot", "buffer", "record_use", "collect", "release_cached", "stats",
           "set_budget", "HostPoolStats"]

_default_lock = threading.Lock()
_default_device: Optional[Device] = None


def _forget_default_in_child() -> None:
    """After fork(), in the child: the default device is the parent's, which refuses the child's
    calls, so the child's first call makes one of its own; the lock may have been held by a
    parent's thread that is not in the child."""
    global _default_device, _default_lock
    _default_device = None
    _default_lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork()
    os.register_at_fork(after_in_child=_forget_default_in_child)


def _device(device: Any, who: str) -> Device:
    """``device``, or the default device (``ringflow.device()``, made once and kept)."""
    global _default_device
    if device is None:
        with _default_lock:
            if _default_device is None:
                from ._device import device as make_device

                _default_device = make_device()
            return _default_device
    if isinstance(device, Device):
        return device
    if isinstance(device, str):
        raise TypeError(f"ringflow.host.{who}(device=...) takes a Device, not the spec {device!r}: a spec would "
                        f"make a new device (and a new pool) each call; make one with dev = ringflow.device("
                        f"{device!r}) and pass device=dev every time")
    raise TypeError(f"ringflow.host.{who}(device=...) takes a ringflow Device or None, got {type(device).__name__}")


def _pool(device: Any, who: str) -> HostPool:
    return pool_for(_device(device, who))


def empty(shape: "int | Sequence[int]", dtype: Any = np.float64, *, device: Optional[Device] = None) -> np.ndarray:
    """A new C-contiguous array of uninitialised pinned host memory, from ``device``'s pool.

    Args:
        shape: an int or a sequence of ints (each >= 0), as for ``numpy.empty``.
        dtype: any numpy dtype without Python objects (default float64).
        device: the device whose copy engines will use the array; None for the default device
            (``ringflow.device()``, made on first use and kept for the process).

    Returns:
        A plain ``numpy.ndarray`` whose memory returns to the pool once it and all its views are
        collected. Ordinary pageable memory instead when the request does not fit the pool's
        budget or the device refuses to pin it (counted in :func:`stats` as a fallback).

    Raises:
        TypeError: a bad ``shape``, a dtype holding objects, or ``device`` that is not a Device.
        ValueError: a negative dimension, more than 64 dimensions, or a shape numpy cannot index.
        RuntimeError: ``device`` is closed.
    """
    # checked before the default device is made: a refused call must leave nothing behind
    shape, dtype = check_shape_dtype(shape, dtype)
    return _pool(device, "empty").empty(shape, dtype)


def empty_like(a: np.ndarray, dtype: Any = None, *, device: Optional[Device] = None) -> np.ndarray:
    """:func:`empty` with ``a``'s shape and dtype (or ``dtype``), on ``a``'s pool's device when
    ``a`` came from :func:`empty` and ``device`` is None.

    Raises:
        TypeError: ``a`` is not a numpy array; otherwise as :func:`empty`.
        RuntimeError: ``device`` is None and ``a``'s device is closed (pass ``device=``);
            otherwise as :func:`empty`.
    """
    if not isinstance(a, np.ndarray):
        raise TypeError(f"ringflow.host.empty_like takes a numpy array, got {type(a).__name__}")
    shape, dtype = check_shape_dtype(a.shape, a.dtype if dtype is None else dtype)  # before any device is made
    if device is None:
        owner = owner_of(a)
        device = owner.pool.device if owner is not None else None
        if getattr(device, "closed", False):
            raise RuntimeError(f"ringflow.host.empty_like: the device of `a` ({device!r}) is closed; pass device= "
                               f"to make the array on another device")
    return _pool(device, "empty_like").empty(shape, dtype)


def buffer(a: np.ndarray) -> Optional[HostBuffer]:
    """The pinned buffer behind ``a`` (an array from :func:`empty` or a view of one), for the
    APIs that take one: ``x_buffer``/``out_buffer`` of :class:`ringflow.MapJob`, copies on a
    :class:`~ringflow.Device`'s streams. None for any other array.

    A buffer from here belongs to the pool: never close it, and use it only while ``a`` lives.

    The calling thread is ordered after ``a``'s hand-out and every device use of it seen
    complete since (on the simulated GPU; nothing to do on a real one), as ``stream_map``
    taking ``a`` in is: ``a`` may have come from another thread by a queue or a join of your
    own, which the simulated GPU's checker cannot see.

    Raises:
        TypeError: ``a`` is not a numpy array.
    """
    if not isinstance(a, np.ndarray):
        raise TypeError(f"ringflow.host.buffer takes a numpy array, got {type(a).__name__}")
    # the buffer is taken for device work (copies of the caller's own): order this thread after
    # the block's previous holders, or such a copy of an array from another thread looks unordered
    return block_buffer_taken_in(a)


def record_use(a: np.ndarray, event: Any) -> bool:
    """Declare that a device operation you enqueued reads or writes ``a``'s memory and completes
    at ``event``: after ``a`` is dropped its memory is not handed out again before ``event`` is
    done. ``stream_map`` and ``MapJob`` calls need none (they return only once their copies are
    done); record the copies you enqueue yourself on a device's streams.

    Args:
        a: an array from :func:`empty` (or a view of one).
        event: an event recorded on the copy's stream after the copy (``stream.record()``).

    Returns:
        True if recorded; False when ``a`` is not pooled memory (a fallback or any other array),
        which needs nothing held.

    Raises:
        TypeError: ``a`` is not a numpy array, or ``event`` is not an event.
        ValueError: ``event`` was recorded on another device than the one ``a``'s pool serves.
    """
    if not isinstance(a, np.ndarray):
        raise TypeError(f"ringflow.host.record_use takes a numpy array, got {type(a).__name__}")
    owner = owner_of(a)
    if owner is None:
        if not hasattr(event, "is_done"):
            raise TypeError(f"ringflow.host.record_use needs an event (stream.record()), got {type(event).__name__}")
        return False
    return owner.pool.record_use(a, event)


def collect(*, device: Optional[Device] = None, wait: bool = False) -> int:
    """Take back dropped arrays' memory whose recorded operations are all done (with ``wait``,
    after waiting for the rest). :func:`empty` does this itself; call it to see the memory
    free in :func:`stats` or before timing.

    Args:
        device: whose pool (None: the default device's).
        wait: block until every recorded operation on a dropped array is done.

    Returns:
        Bytes made ready for reuse (memory freed because the pool is over its budget
        is not counted: it is given back to the system, not kept).

    Raises:
        TypeError: ``wait`` is not a bool, or ``device`` is not a Device or None.
    """
    # any truthy value would block until every recorded operation is done: wait="no" too
    wait = check_flag("ringflow.host.collect: wait", wait)
    return _pool(device, "collect").collect(wait=wait)


def release_cached(*, device: Optional[Device] = None) -> int:
    """Free the pool's cached (unused) pinned memory back to the system; memory behind live
    arrays and memory a device operation may still use stay.

    Returns:
        Bytes freed.
    """
    return _pool(device, "release_cached").release_cached()


def stats(*, device: Optional[Device] = None) -> HostPoolStats:
    """The counters of ``device``'s pool (None: the default device's): bytes cached, in use and
    pending, allocations, cache hits, fallbacks to pageable memory, releases, and the budget."""
    return _pool(device, "stats").stats()


def set_budget(nbytes: int, *, device: Optional[Device] = None) -> None:
    """Bound the pinned memory a pool may hold (in use, pending and cached together).

    Args:
        nbytes: bytes; by default a pool may hold a quarter of physical memory, at most 4 GiB.
        device: that device's pool only; None sets the budget of every pool, present and future.

    Cached memory beyond the new budget is freed at once; memory behind live arrays stays,
    and later requests get pageable memory until they fit. While the pool holds more than the
    budget, a dropped array's memory is freed (once every operation recorded on it is done)
    rather than cached.

    Raises:
        TypeError, ValueError: ``nbytes`` is not a positive int.
    """
    if device is None:
        set_default_budget(nbytes)
    else:
        _pool(device, "set_budget").set_budget(nbytes)
