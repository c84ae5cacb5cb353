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


def check_pinning_within_a_page(device, refused) -> None:
    """What a GPU's driver does, and the simulated GPU must: bytes pinned already are refused (as
    ``refused``, an exception type), the rest of their page is pinned."""
    page = mmap.PAGESIZE
    base = own_pages(4 * page, np.uint8)
    first = device.register_host(base[page:page + 100])
    try:
        device.register_host(base[page + 200:page + 300]).close()
        try:
            device.register_host(base[page + 50:page + 150]).close()
        except refused as exc:
            assert "HOST_MEMORY_ALREADY_REGISTERED" in str(exc), exc
        else:
            raise AssertionError("bytes pinned already were pinned again")
    finally:
        first.close()
