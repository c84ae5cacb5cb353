"""Arrays a ``prepare`` makes in the pinned slot its item goes to (``ringflow.host.empty_slot``).

A ``prepare`` that returns a new array has it copied into its host-in slot; one that builds its
result in the slot itself skips that copy, and the page faults of a fresh allocation. While a
pipeline runs ``prepare(item)`` (on a CPU worker thread, or in a worker process with
``processes=True``), the slot is offered to :func:`empty_slot` on that thread; the first call that
fits takes it, and the stage then finds the returned array at the slot's first byte and moves
nothing. Anywhere else (another thread, a second call, an array larger than the slot) it is a
new numpy array, so one ``prepare`` serves a pipeline and a DataLoader alike.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Optional

import numpy as np
from numpy.lib.array_utils import byte_bounds

from .._device.host_pool import check_shape_dtype

_offered = threading.local()


def empty_slot(shape: Any, dtype: Any = np.float64) -> np.ndarray:
    """An uninitialised C-contiguous array: inside a pipeline's ``prepare``, in the pinned slot
    its item goes to; elsewhere a new numpy array.

    Returned by ``prepare`` as it is (the same array, any reshape or view of it starting at its
    first byte), it is moved to the device with no copy. It belongs to the pipeline once
    ``prepare`` returns: keep no reference to it (returned by a later ``prepare``, it lies in
    another item's slot, and that item fails with a ValueError). Only the first call in one ``prepare`` gets the
    slot; later calls, and arrays larger than the slot, get new arrays.

    Raises:
        TypeError: a shape that is not an int or a sequence of ints, a dtype numpy does not
            know, or one holding Python objects (the message starts ``empty_slot``).
        ValueError: a negative dimension, or more bytes than numpy can make (the message
            starts ``empty_slot``).
    """
    try:
        shape, dtype = check_shape_dtype(shape, dtype)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"empty_slot: {exc}") from None
    raw: Optional[np.ndarray] = getattr(_offered, "raw", None)
    nbytes = math.prod(shape) * dtype.itemsize
    if raw is None or nbytes > raw.nbytes or raw.ctypes.data % dtype.alignment:
        try:
            return np.empty(shape, dtype)
        except ValueError as exc:  # numpy's words name neither this call nor the fix
            raise ValueError(f"empty_slot(shape={shape}, dtype={dtype}): {nbytes} bytes, more than numpy can make "
                             f"({exc}); ask for a smaller shape") from None
    _offered.raw = None  # taken: a second call gets its own memory
    return raw[:nbytes].view(dtype).reshape(shape)


def run_offering(prepare: Callable[[Any], Any], item: Any, raw: np.ndarray) -> Any:
    """``prepare(item)`` with ``raw`` (the item's host-in slot, bytes) offered to
    :func:`empty_slot` on this thread; the offer ends when ``prepare`` returns or raises, and an
    offer made around this one (a prepare run inside another on one thread) stands again."""
    outer = getattr(_offered, "raw", None)
    _offered.raw = raw
    try:
        return prepare(item)
    finally:
        _offered.raw = outer


def in_slot(arr: np.ndarray, raw: np.ndarray) -> bool:
    """Whether ``arr`` already lies where its bytes must go: C-contiguous from ``raw``'s first
    byte, within it."""
    return (arr.flags.c_contiguous and arr.nbytes <= raw.nbytes and arr.nbytes > 0
            and arr.ctypes.data == raw.ctypes.data)


def check_in_its_slot(arrays: Any, raw: np.ndarray, ring: np.ndarray) -> None:
    """Raise where one of ``arrays`` (those a ``prepare`` returned) lies in ``ring``, the bytes
    of the pipeline's host-in ring (pinned slots, or the shared block of ``processes=True``),
    outside ``raw``, the item's own slot: an array from an earlier prepare's :func:`empty_slot`,
    kept past its return, lies in a slot that holds another item now (or is being written for
    one), and copying it would send that item's bytes. Compares address ranges only: no byte
    is read.

    Raises:
        ValueError: such an array, saying so.
    """
    for arr in arrays:
        if not isinstance(arr, np.ndarray) or arr.size == 0 or not np.may_share_memory(arr, ring):
            continue
        low, high = byte_bounds(arr)
        start = raw.ctypes.data
        if low < start or high > start + raw.nbytes:
            raise ValueError(
                "prepare returned an array lying in another item's slot of the pipeline's pinned host-in memory ("
                "an array ringflow.host.empty_slot gave an earlier prepare, kept after that prepare returned): that "
                "slot holds another item's data now. An empty_slot array belongs to the pipeline once prepare "
                "returns: call empty_slot in each prepare and keep no reference to what it returns (copy it to "
                "keep its data)")
