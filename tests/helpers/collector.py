"""The cyclic garbage collector switched off, so a test proves memory is freed by reference
counting alone (as soon as the last reference goes), not by a later collection."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """The cyclic collector off (what it already had to free collected first), back on after."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
