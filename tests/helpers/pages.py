"""Host arrays on pages of their own, for tests that place ranges within a page exactly."""

from __future__ import annotations

import mmap

import numpy as np


def own_pages(n: int, dtype=np.float32) -> np.ndarray:
    """``n`` zeros of ``dtype`` starting on a page boundary, no other array on their pages."""
    nbytes = n * np.dtype(dtype).itemsize
    raw = np.zeros(-(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE + mmap.PAGESIZE - 1, np.uint8)
    start = -raw.ctypes.data % mmap.PAGESIZE
    return raw[start:start + nbytes].view(dtype)
