"""The host's time per chunk of ringflow's engines, measured on a device.

A long run of small chunks is bound by the host, not the GPU: the scheduled engine's enqueues,
event queries and hand-offs to its CPU workers when it stages, the same engine's enqueues and
event queries when it runs a job on the caller's pinned memory (``engine="pipeline"``), or the
direct engine's enqueueing on that memory. The planner counts that time as a resource of its
own (``_plan.host_seconds_per_chunk``), and how long it is depends on the host's CPU, not the
GPU. ``ringflow doctor --save`` measures it here and writes it into the
hardware profile, so each machine plans with its own figure.

Each figure is the difference between two calls over the same small chunks, one five times as
long as the other, divided by the difference in chunks: what a call costs once (making and
closing its engine, its arrays) cancels out, and what is left is the time per chunk of a long
run. The calls keep no engine warm, so the measurement leaves no streams or device memory behind.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import numpy as np

CHUNK_BYTES = 64 << 10  # small enough that the host, not the link, bounds the run on any GPU
SHORT_CHUNKS, LONG_CHUNKS = 128, 640


def _copy(x: Any, y: Any) -> None:
    y[...] = x


def _per_chunk(run: Callable[[int], None], repeats: int) -> float:
    """Seconds per chunk: the median over ``repeats`` of (long call - short call) / the chunks
    between them; ``run(n)`` makes one call over ``n`` chunks (warmed up once first)."""
    run(SHORT_CHUNKS)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(SHORT_CHUNKS)
        t1 = time.perf_counter()
        run(LONG_CHUNKS)
        t2 = time.perf_counter()
        samples.append(((t2 - t1) - (t1 - t0)) / (LONG_CHUNKS - SHORT_CHUNKS))
    # a call slowed more than another by the machine could make a difference negative: a
    # figure the profile must hold is more than 0
    return max(statistics.median(samples), 1e-9)


def chunk_host_seconds(dev: Any, *, repeats: int = 3) -> dict[str, float]:
    """The host's seconds per chunk of a long run of 64 KiB chunks on ``dev``, by engine.

    Args:
        dev: an open ringflow Device.
        repeats: timed pairs of calls per engine (the median is kept); at least 1.

    Returns:
        ``{"staged": s, "one_side": s, "scheduled": s, "direct": s}``: ``staged`` for ordinary
        (pageable) numpy arrays staged through pinned rings by the scheduled engine and its CPU
        workers (``host="stage"``), ``one_side`` for an ordinary input staged so into a result of
        :mod:`ringflow.host` memory used in place (``host="auto"`` held to staging by a
        ``pinned_budget`` under the input's bytes; None where the pool could not give pinned
        memory), ``scheduled`` for pinned arrays the scheduled engine hands to the copy engines
        in place (``engine="pipeline"``), ``direct`` for pinned arrays the direct engine hands to
        them in place. Each figure is more than 0.

    Raises:
        ValueError: ``repeats`` is below 1.
        RuntimeError: the results differ from the inputs (the device copied wrongly).
    """
    from ._device import host_pool
    from ._device.protocol import close_quietly
    from ._pipeline import stream_map

    if repeats < 1:
        raise ValueError(f"repeats must be 1 or more, got {repeats}")
    n = LONG_CHUNKS * CHUNK_BYTES // 4
    per_chunk = CHUNK_BYTES // 4
    x = np.random.default_rng(0).random(n, dtype=np.float32)
    y = np.empty_like(x)
    # pinned buffers of its own, not ringflow.host's pool, which hands out pageable memory when
    # its budget is spent (and the direct engine then cannot run)
    made = []
    try:
        made.append(dev.allocate_host(x.nbytes))
        made.append(dev.allocate_host(x.nbytes))
        x_buffer, y_buffer = made
        x_buffer.view(np.float32, access="w")[...] = x

        def staged(chunks: int) -> None:
            stream_map(_copy, x[:chunks * per_chunk], y[:chunks * per_chunk], device=dev, chunk_bytes=CHUNK_BYTES,
                       host="stage", keep_warm=False)

        def pinned(engine: str) -> Callable[[int], None]:
            def run(chunks: int) -> None:
                # (fresh views each call: a buffer's view is a host access at the moment it is taken)
                stream_map(_copy, x_buffer.view(np.float32, count=chunks * per_chunk),
                           y_buffer.view(np.float32, count=chunks * per_chunk), device=dev, chunk_bytes=CHUNK_BYTES,
                           x_buffer=x_buffer, out_buffer=y_buffer, engine=engine, keep_warm=False)
            return run

        # the result in ringflow.host memory, used in place; the input ordinary memory, which a
        # budget under its bytes keeps host="auto" from registering: it is staged alone. (Held in
        # a list, emptied once measured, so that the pool can take the block back.)
        pool = host_pool.pool_for(dev)
        # a pool that already caches blocks is the caller's to keep: the measurement frees the
        # cache only where it made it (the first use of a device calibrates inside a user's run)
        cached_before = pool.stats().cached_bytes
        pooled = [pool.empty(x.shape, x.dtype)]
        one_side_ok = host_pool.buffer_behind(pooled[0], dev) is not None

        def one_side(chunks: int) -> None:
            stream_map(_copy, x[:chunks * per_chunk], pooled[0][:chunks * per_chunk], device=dev,
                       chunk_bytes=CHUNK_BYTES, host="auto", pinned_budget=chunks * CHUNK_BYTES - 1, keep_warm=False)

        result = {"staged": _per_chunk(staged, repeats),
                  "one_side": _per_chunk(one_side, repeats) if one_side_ok else None,
                  "scheduled": _per_chunk(pinned("pipeline"), repeats), "direct": _per_chunk(pinned("direct"), repeats)}
        one_side_right = not one_side_ok or np.array_equal(pooled[0], x)
        pooled.clear()
        if cached_before == 0:
            pool.release_cached()  # (the measurement leaves nothing in the pool either)
        if not (one_side_right and np.array_equal(y, x) and np.array_equal(y_buffer.view(np.float32, access="r"), x)):
            raise RuntimeError("the host-time measurement's chunks came back different from what went in: "
                               "this GPU or its driver is not copying correctly; run ringflow doctor to check it")
    finally:
        for buffer in made:
            close_quietly(buffer, "a host-time measurement buffer")
    return result
