"""Kernel and copy times on a real GPU, to size the 'balanced' and 'compute-bound' kernels."""

from __future__ import annotations

import numpy as np

from ..device.timing import time_events
from . import kernels


def kernel_and_copy_ms(dev, chunk_bytes: int, repeats: int = 5) -> tuple[float, float, float]:
    """(seconds of the 1-iteration kernel, of the 65-iteration kernel, of one H2D copy) on a
    chunk of ``chunk_bytes``, each the median of ``repeats`` event-timed runs after a warm-up."""
    n = chunk_bytes // 4
    s = dev.create_stream()
    hb = dev.allocate_host(n * 4)
    d = dev.allocate(n * 4, stream=s)
    try:
        hb.view(np.float32, access="w")[:] = np.random.default_rng(0).uniform(0.5, 1.5, n).astype(np.float32)
        arr = d.array(np.float32, n)

        def timed(enqueue) -> float:
            return float(np.median(time_events(s, enqueue, warmup=1, repeats=repeats)))

        copy = timed(lambda: s.copy(d, hb))
        k1 = timed(lambda: s.launch(kernels.affine(1), arr, arr, writes=[arr]))
        k65 = timed(lambda: s.launch(kernels.affine(65), arr, arr, writes=[arr]))
        return k1, k65, copy
    finally:
        d.close(stream=s)
        s.sync()
        hb.close()
        s.close()
