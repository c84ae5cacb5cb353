"""Module-level prepare functions for ``Pipeline(processes=True)`` tests: worker processes get
them by reference, so they cannot live inside a test."""

from __future__ import annotations

import os

import numpy as np


def ramp(item: int) -> np.ndarray:
    """A float32 array of ``item % 97 + 1`` elements counting up from ``item``."""
    return np.arange(item, item + item % 97 + 1, dtype=np.float32)


def ramp_and_pid(item: int) -> np.ndarray:
    """Element 0: the worker's process id (as float64); then :func:`ramp` of ``item``."""
    return np.concatenate([[float(os.getpid())], ramp(item).astype(np.float64)])


def fails_on_7(item: int) -> np.ndarray:
    if item == 7:
        raise ValueError("item 7 is broken")
    return ramp(item)


def not_an_array(item: int):
    return [item]


def not_anything(item: int):
    return f"item {item}"


def too_big(item: int) -> np.ndarray:
    return np.zeros(1 << 20, np.uint8)


def dies_on_3(item: int) -> np.ndarray:
    """Kills its worker process on item 3 (a crash, not an exception)."""
    if item == 3:
        os._exit(7)
    return ramp(item)


def ramp_in_slot(item: int) -> np.ndarray:
    """:func:`ramp` built in the item's pinned slot (``ringflow.host.empty_slot``)."""
    import ringflow as rf

    n = item % 97 + 1
    out = rf.host.empty_slot((n,), np.float32)
    out[:] = np.arange(item, item + n, dtype=np.float32)
    return out


class NeedsTwoArguments(Exception):
    """Pickles, but cannot be unpickled: pickle rebuilds it from ``args``, one argument."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class HoldsALambda(Exception):
    """Cannot be pickled at all: it holds a lambda."""

    def __init__(self, message: str):
        super().__init__(message)
        self.check = lambda: None


def fails_on_5_unpicklably(item: int) -> np.ndarray:
    """Item 5 raises an exception that cannot travel back from a worker process (unpickling it fails)."""
    if item == 5:
        raise NeedsTwoArguments("item 5 is broken", 5)
    return ramp(item)


def fails_on_5_with_a_lambda(item: int) -> np.ndarray:
    """Item 5 raises an exception that cannot be pickled in the worker process."""
    if item == 5:
        raise HoldsALambda("item 5 is broken")
    return ramp(item)
