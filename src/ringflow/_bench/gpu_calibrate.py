"""Kernel and copy times on a real GPU, to size the 'balanced' and 'compute-bound' kernels."""

from __future__ import annotations

import contextlib

import numpy as np

from .._device.timing import time_events
from . import kernels


def iters_for(dev, chunk_bytes: int, ratio: float, repeats: int = 5, rounds: int = 6) -> tuple[int, float, float]:
    """Iterations of the affine kernel whose time on a ``chunk_bytes`` chunk is ``ratio`` times
    that chunk's H2D copy; returns (iterations, kernel seconds, copy seconds), each time the
    median of ``repeats`` event-timed runs after a warm-up.

    The kernel's time is a pass over memory plus a cost per iteration, and one iteration costs
    a small fraction of a chunk's copy (docs/design.md, "Calibration notes"), so a slope taken
    from a few iterations is noise: instead the count is scaled by target/measured until the
    measured time is within 3% of the target (two or three rounds)."""
    n = chunk_bytes // 4
    with _device_chunk(dev, chunk_bytes) as (s, d):
        hb = dev.allocate_host(n * 4)
        try:
            hb.view(np.float32, access="w")[:] = np.random.default_rng(0).uniform(0.5, 1.5, n).astype(np.float32)
            copy = _timed(s, lambda: s.copy(d, hb), repeats)
        finally:
            hb.close()
        arr = d.array(np.float32, n)
        target = ratio * copy
        iters, seconds = 64, 0.0
        for _ in range(rounds):
            f = kernels.affine(iters)
            seconds = _timed(s, lambda: s.launch(f, arr, arr, writes=[arr]), repeats)
            if abs(seconds - target) <= 0.03 * target:
                break
            iters = max(1, round(iters * target / seconds))
        return iters, seconds, copy


def kernel_seconds(dev, f, chunk_bytes: int, repeats: int = 5) -> float:
    """Seconds of one launch of compute function ``f(x, x)`` on a float32 chunk of
    ``chunk_bytes`` (median of ``repeats`` event-timed runs after a warm-up)."""
    with _device_chunk(dev, chunk_bytes) as (s, d):
        s.fill(d, 0x3F)  # ~0.75 as float32: finite values, like the workload's
        arr = d.array(np.float32, chunk_bytes // 4)
        return _timed(s, lambda: s.launch(f, arr, arr, writes=[arr]), repeats)


@contextlib.contextmanager
def _device_chunk(dev, chunk_bytes: int):
    """A stream and a device buffer of ``chunk_bytes`` on it, freed in its order afterwards."""
    s = dev.create_stream()
    d = dev.allocate(chunk_bytes, stream=s)
    try:
        yield s, d
    finally:
        d.close(stream=s)
        s.sync()
        s.close()


def _timed(stream, enqueue, repeats: int) -> float:
    return float(np.median(time_events(stream, enqueue, warmup=1, repeats=repeats)))
