"""Measurements of a real GPU for ``ringflow doctor``: copy bandwidth and copy/compute overlap
(:func:`measure`), and the rest of a hardware profile (:func:`measure_model`).

Rules: device time comes from timing events around the region; every figure is the median of
several repeats after warm-up, reported with its spread; data is random, never zeros; a round
trip is checked bit-exact so a broken copy cannot look fast. Pageable copies, enqueue costs and
host work are timed with the host clock, since the host does that work.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

import numpy as np

from ..protocol import close_quietly
from ..timing import time_events
from ._lib import check, core, driver
from .device import CudaDevice
from .stream import CudaStream

KiB, MiB = 1 << 10, 1 << 20

SPIN_SOURCE = r"""
extern "C" __global__ void ringflow_spin(unsigned long long ns, unsigned int* out) {
    // Busy-wait on the global nanosecond timer: a kernel that takes a set time whatever the clock.
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
    if (threadIdx.x == 0) out[blockIdx.x] = (unsigned int)(now - start);
}
"""


def summary(seconds: list[float], nbytes: int | None = None) -> dict[str, Any]:
    """Median and spread of repeated timings (and the bandwidth they give, GB/s = 1e9 B/s)."""
    s = sorted(seconds)
    out: dict[str, Any] = {"repeats": len(s), "median_ms": statistics.median(s) * 1e3,
                           "min_ms": s[0] * 1e3, "max_ms": s[-1] * 1e3}
    if nbytes:
        out["bytes"] = nbytes
        out["GBps"] = nbytes / statistics.median(s) / 1e9
        out["GBps_min"] = nbytes / s[-1] / 1e9
        out["GBps_max"] = nbytes / s[0] / 1e9
    return out


class Spin:
    """The NVRTC-compiled spin kernel, launched on ``sm_count`` blocks (one per SM)."""

    def __init__(self, dev: CudaDevice):
        cc = core()
        dev._ensure_current()
        arch = dev._cc.arch
        prog = cc.Program(SPIN_SOURCE, "c++", options=cc.ProgramOptions(arch=f"sm_{arch}", name="ringflow_spin"))
        self.kernel = prog.compile("cubin").get_kernel("ringflow_spin")
        self.grid = dev.capabilities.sm_count
        self.out = dev.allocate(4 * self.grid)
        self.config = cc.LaunchConfig(grid=self.grid, block=32)

    def __call__(self, stream: CudaStream, seconds: float) -> None:
        core().launch(stream._cc, self.config, self.kernel, np.uint64(int(seconds * 1e9)), self.out.ptr)

    def close(self) -> None:
        self.out.close()


def time_together(s1: CudaStream, s2: CudaStream, spin: Spin, f1: Callable[[CudaStream], None],
                  f2: Callable[[CudaStream], None], warmup: int, repeats: int) -> list[float]:
    """Seconds from a common start to both ``f1`` on ``s1`` and ``f2`` on ``s2`` being done.

    A short spin kernel gates ``s1`` so that both streams' work is enqueued before either
    starts; ``s2`` waits on the start event, and ``s1`` waits on ``s2``'s end before the end
    event, so the span covers both."""
    times = []
    for i in range(warmup + repeats):
        spin(s1, 300e-6)
        e0 = s1.record(timing=True)
        s2.wait(e0)
        f1(s1)
        f2(s2)
        s1.wait(s2.record())
        e1 = s1.record(timing=True)
        e1.sync()
        if i >= warmup:
            times.append(e1.elapsed_since(e0))
    return times


def raw_copy(stream: CudaStream, dst: int, src: int, nbytes: int) -> None:
    """cuMemcpyAsync between raw addresses (used for pageable numpy memory, which is no Buffer)."""
    check(driver().cuMemcpyAsync(dst, src, nbytes, stream._cc.handle), "cuMemcpyAsync")


def measure(dev: CudaDevice, *, big: int = 256 * MiB, repeats: int = 10, seed: int = 0) -> dict[str, Any]:
    """Every doctor measurement on ``dev``; returns a JSON-ready dict."""
    rng = np.random.default_rng(seed)
    res: dict[str, Any] = {"big_copy_bytes": big}
    t_start = time.perf_counter()
    s1, s2 = dev.create_stream(), dev.create_stream()
    h_src, h_dst = dev.allocate_host(big), dev.allocate_host(big)
    d_a, d_b = dev.allocate(big, stream=s1), dev.allocate(big, stream=s1)
    spin = Spin(dev)
    try:
        rng.random(out=h_src.view(np.float32), dtype=np.float32)
        h_dst.view(np.uint8).fill(0xA5)
        s1.copy(d_b, h_src)  # d_b holds data for the D2H half of the duplex test
        s1.sync()

        res["h2d_pinned"] = summary(time_events(s1, lambda: s1.copy(d_a, h_src), 2, repeats), big)
        res["d2h_pinned"] = summary(time_events(s1, lambda: s1.copy(h_dst, d_a), 2, repeats), big)
        res["roundtrip_bit_exact"] = bool(np.array_equal(h_dst.view(np.uint64), h_src.view(np.uint64)))
        both = time_together(s1, s2, spin, lambda s: s.copy(d_a, h_src), lambda s: s.copy(h_dst, d_b), 2, repeats)
        res["duplex_pinned"] = summary(both, 2 * big)
        res["duplex_pinned"]["note"] = "H2D and D2H of the same size at once; GB/s is the sum of both directions"

        res["pageable"] = _pageable(dev, s1, d_a, big, rng, max(3, repeats // 2))
        res["pinned_h2d_by_size"], res["pinned_d2h_by_size"] = _by_size(s1, h_src, h_dst, d_a, big)
        res["overlap"] = _overlap(s1, s2, spin, d_a, h_src, repeats)
    finally:
        for obj in (spin, d_a, d_b, h_src, h_dst, s1, s2):
            obj.close()
    res["seconds"] = time.perf_counter() - t_start
    return res


def _pageable(dev: CudaDevice, s: CudaStream, d: Any, big: int, rng: np.random.Generator,
              repeats: int) -> dict[str, Any]:
    src = rng.random(big // 4, dtype=np.float32)  # pageable (ordinary numpy) memory, touched
    dst = np.empty_like(src)
    dst.fill(1.0)

    def wall(fn: Callable[[], None]) -> list[float]:
        fn()
        s.sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            s.sync()
            times.append(time.perf_counter() - t0)
        return times

    h2d = wall(lambda: raw_copy(s, d.ptr, src.ctypes.data, big))
    d2h = wall(lambda: raw_copy(s, dst.ctypes.data, d.ptr, big))
    exact = bool(np.array_equal(src, dst))
    # The synchronous cuMemcpy (legacy default stream), as torch's .cuda()/.cpu() and cudaMemcpy use.
    dst.fill(1.0)
    h2d_sync = wall(lambda: check(driver().cuMemcpy(d.ptr, src.ctypes.data, big), "cuMemcpy"))
    d2h_sync = wall(lambda: check(driver().cuMemcpy(dst.ctypes.data, d.ptr, big), "cuMemcpy"))
    exact = exact and bool(np.array_equal(src, dst))
    return {"h2d": summary(h2d, big), "d2h": summary(d2h, big),
            "h2d_sync": summary(h2d_sync, big), "d2h_sync": summary(d2h_sync, big), "bit_exact": exact,
            "method": "host clock around the copy + stream sync (the host stages pageable memory); "
                      "h2d/d2h: cuMemcpyAsync on a non-blocking stream; *_sync: synchronous cuMemcpy"}


def _by_size(s: CudaStream, h_src: Any, h_dst: Any, d: Any, big: int) -> tuple[list, list]:
    h2d, d2h = [], []
    size = 64 * KiB
    while size <= big:
        reps = int(min(50, max(10, (64 * MiB) // size)))
        t = time_events(s, lambda n=size: s.copy(d.slice(0, n), h_src.slice(0, n)), 3, reps)
        h2d.append(summary(t, size))
        t = time_events(s, lambda n=size: s.copy(h_dst.slice(0, n), d.slice(0, n)), 3, reps)
        d2h.append(summary(t, size))
        size *= 4
    return h2d, d2h


def _overlap(s1: CudaStream, s2: CudaStream, spin: Spin, d: Any, h_src: Any, repeats: int) -> dict[str, Any]:
    """Does an H2D copy on one stream run beside a kernel on another? The kernel is set to take
    as long as the copy; fraction = (t_copy + t_kernel - t_both) / min(t_copy, t_kernel):
    1 is full overlap, 0 is none."""
    copy = lambda s: s.copy(d, h_src)  # noqa: E731
    t_copy = statistics.median(time_events(s1, lambda: copy(s1), 2, repeats))
    kern = lambda s: spin(s, t_copy)  # noqa: E731
    t_kernel = statistics.median(time_events(s2, lambda: kern(s2), 2, repeats))
    both = time_together(s1, s2, spin, copy, kern, 2, repeats)
    t_both = statistics.median(both)
    fraction = (t_copy + t_kernel - t_both) / min(t_copy, t_kernel)
    return {"t_copy_ms": t_copy * 1e3, "t_kernel_ms": t_kernel * 1e3, "t_both_ms": t_both * 1e3,
            "t_both": summary(both), "fraction": fraction,
            "kernel": f"NVRTC spin kernel on {spin.grid} blocks x 32 threads, sized to the copy",
            "copy": f"pinned H2D of {d.nbytes} bytes"}


# -- what a hardware profile needs beyond the copies above ---------------------------------------------------------
# thread counts of the host copy rates (capped by the CPUs there are); two among them, since the
# staging rate climbs too steeply between one thread and four to be read between those points
HOST_THREADS = (1, 2, 4, 8, 16)


def thread_counts(cpus: "int | None") -> tuple[int, ...]:
    """The thread counts to time host copies with on ``cpus`` CPUs: :data:`HOST_THREADS` up to
    ``cpus``, and ``cpus`` itself when it falls between them (at most 16)."""
    cpus = max(1, min(16, cpus or 1))
    return tuple(sorted({t for t in HOST_THREADS if t <= cpus} | {cpus}))


def register_call_seconds(dev: Any, *, calls: int = 200, repeats: int = 5) -> float:
    """Host seconds to register one touched page of pageable memory in place and unregister it
    (``dev.register_host`` and the buffer's ``close``): the fixed cost of pinning an array, which
    the bytes-per-second rates leave out. The median over ``repeats`` passes of ``calls`` pairs
    (each pair of a pass on a page of its own), after a warm-up pass; > 0 on any device.

    Args:
        dev: the device (any backend).
        calls: register-unregister pairs a pass.
        repeats: passes timed.
    """
    page = 4 * KiB
    memory = np.ones((calls + 1) * page, np.uint8)  # touched, so no pair faults pages in
    skip = (-memory.ctypes.data) % page  # the first page boundary in the allocation
    pages = [memory[skip + i * page: skip + (i + 1) * page] for i in range(calls)]
    passes = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for one in pages:
            dev.register_host(one).close()
        passes.append((time.perf_counter() - t0) / calls)
    return max(statistics.median(passes[1:]), 1e-9)


def measure_model(dev: Any, *, nbytes: int = 256 * MiB, staging_bytes: int = 1024 * MiB, repeats: int = 5,
                  calls: int = 200, cpus: "int | None" = None,
                  kernel: "Callable[[Any, float], None] | None" = None) -> dict[str, Any]:
    """The figures of a hardware profile that :func:`measure` does not take, on ``dev`` and
    this host; returns a JSON-ready dict.

    * ``device_GBps``: a device-to-device copy of ``nbytes``, bytes read plus written per second;
    * ``kernel_min_s``: the shortest kernel (``kernel`` asked to wait 0 s), event-timed;
    * ``launch_overhead_s``, ``copy_overhead_s``, ``event_overhead_s``: host seconds per
      kernel launch, per 4 KiB copy enqueued, per event recorded or queried (``calls`` calls
      timed on the device's host clock, ``dev.now``, the stream synced afterwards);
    * ``host_task_overhead_s``: host seconds per empty task through a one-worker pool;
    * ``host_copy_GBps``: ``[threads, GB/s]`` of a parallel memcpy of ``nbytes`` from touched
      pageable memory into pinned memory, for :func:`thread_counts`;
    * ``register_GBps``, ``register_fresh_GBps``, ``unregister_GBps``: pinning ``nbytes`` of
      touched and of never-touched pageable memory in place, and unpinning it;
    * ``register_call_s``: pinning one touched page in place and unpinning it
      (:func:`register_call_seconds`), a registration's cost beyond its bytes;
    * ``first_touch_GBps``: ``[threads, GB/s]`` of the first write to ``nbytes`` of fresh
      pages, on one thread and on the most threads timed;
    * ``staging_GBps``: ``[threads, GB/s]`` of the staged path's memory work at once, in bytes
      of one direction, for :func:`thread_counts`: some of the threads copy ``staging_bytes / 2``
      of touched pageable memory into pinned memory, the rest as many bytes of pinned memory
      into fresh pages (or each copies its part in and then out, by turns), while the device
      copies as many bytes host to device and device to host (pinned buffers of their own), all
      started together and timed until the last ends (host clock; :func:`staging_runs`). On
      ``staging_bytes``, or half as many where memory is short (:func:`staging_buffers`; the
      size taken is ``staging_bytes`` in the result): more bytes than the other figures, since
      a copy of a few hundred MiB each way runs slower than the same work over a whole large
      array, which is what the staged path copies. The fastest run of the splits of the threads
      (:func:`staging_splits`) in two passes, one before the host's other measurements and one
      after them, since the host's memory bandwidth drifts from one second, and one minute, to
      the next: meant as a floor for the staged path on as many threads (docs/performance.md
      says where the path has beaten it).

    Each figure but ``staging_GBps`` is the median of ``repeats`` after a warm-up (seconds,
    GB/s = 1e9 B/s). Device
    spans are timed behind a gate kernel, so that the host's enqueueing is not part of them.

    Args:
        dev: the device (any backend: on the simulated GPU the device figures come back as its
            profile has them, which tests the arithmetic).
        kernel: ``kernel(stream, seconds)`` enqueues a kernel that runs for ``seconds`` (0:
            as short as the device allows); None compiles the spin kernel (a real GPU).
    """
    import concurrent.futures
    import os

    t_start = time.perf_counter()
    threads = thread_counts(cpus if cpus is not None else os.cpu_count())
    res: dict[str, Any] = {"bytes": nbytes, "threads": list(threads)}
    s = dev.create_stream()
    d_a, d_b = dev.allocate(nbytes, stream=s), dev.allocate(nbytes, stream=s)
    h_pin = dev.allocate_host(nbytes)
    s_out = st_in = st_out = st_da = st_db = None  # the staging measurement's own buffers
    spin = Spin(dev) if kernel is None else None
    launch = kernel if kernel is not None else spin
    pool = dev.create_worker_pool(1)
    executor = concurrent.futures.ThreadPoolExecutor(max(threads))
    try:
        s.fill(d_a, 0x3F)

        def gated(enqueue: Callable[[], None]) -> float:
            times = []
            for i in range(repeats + 2):
                launch(s, 200e-6)  # holds the stream while the region is enqueued
                e0 = s.record(timing=True)
                enqueue()
                e1 = s.record(timing=True)
                e1.sync()
                if i >= 2:
                    times.append(e1.elapsed_since(e0))
            return statistics.median(times)

        res["device_GBps"] = 2 * nbytes / gated(lambda: s.copy(d_b, d_a)) / 1e9
        res["kernel_min_s"] = gated(lambda: launch(s, 0.0))

        def per_call(fn: Callable[[], Any], ops_per_call: int = 1) -> float:
            samples = []
            for _ in range(repeats + 1):
                s.sync()
                t0 = dev.now
                for _ in range(calls):
                    fn()
                samples.append((dev.now - t0) / (calls * ops_per_call))
                s.sync()
            return statistics.median(samples[1:])

        small_d, small_h = d_b.slice(0, 4 * KiB), h_pin.slice(0, 4 * KiB)
        res["launch_overhead_s"] = per_call(lambda: launch(s, 0.0))
        res["copy_overhead_s"] = per_call(lambda: s.copy(small_d, small_h))
        res["event_overhead_s"] = per_call(lambda: s.record().is_done, ops_per_call=2)

        def tasks() -> float:
            t0 = dev.now
            last = None
            for _ in range(calls):
                last = pool.submit(_nothing)
            last.sync()
            return (dev.now - t0) / calls

        tasks()
        res["host_task_overhead_s"] = statistics.median(tasks() for _ in range(repeats))

        src = np.empty(nbytes, np.uint8)
        src.fill(0x5A)  # touched, as a caller's array is
        pinned = h_pin.view(np.uint8)

        s_out = dev.create_stream()
        staging_bytes, (st_in, st_out, st_da, st_db, st_src) = staging_buffers(dev, s, staging_bytes,
                                                                               min(nbytes, staging_bytes))
        res["staging_bytes"] = staging_bytes
        staging_s: dict[int, float] = {}

        def staging_pass() -> None:  # each thread count's fastest run so far
            for t in threads:
                runs = [r for t_in in staging_splits(t)
                        for r in staging_runs(s, s_out, st_da, st_db, st_in, st_out, st_src, executor, t_in, t - t_in,
                                              repeats)]
                staging_s[t] = min([staging_s.get(t, math.inf)] + runs)

        staging_pass()  # once before the host's other measurements, once after them

        def parallel(t: int, fn: Callable[[int, int], None]) -> float:
            step = -(-nbytes // t)
            t0 = time.perf_counter()
            list(executor.map(lambda a: fn(a, min(a + step, nbytes)), range(0, nbytes, step)))
            return time.perf_counter() - t0

        def copy_part(a: int, b: int) -> None:
            np.copyto(pinned[a:b], src[a:b])

        res["host_copy_GBps"] = []
        for t in threads:
            runs = [parallel(t, copy_part) for _ in range(repeats + 1)][1:]
            res["host_copy_GBps"].append([t, _rate(nbytes, runs)])

        reg, unreg, reg_fresh = [], [], []
        for i in range(repeats + 1):
            for fresh in (False, True):
                arr = np.empty(nbytes, np.uint8)  # a large allocation: fresh pages, never touched
                if not fresh:
                    arr.fill(1)
                t0 = time.perf_counter()
                buf = dev.register_host(arr)
                t1 = time.perf_counter()
                buf.close()
                t2 = time.perf_counter()
                if i:
                    (reg_fresh if fresh else reg).append(t1 - t0)
                    if not fresh:
                        unreg.append(t2 - t1)
                del buf, arr
        res["register_GBps"] = _rate(nbytes, reg)
        res["register_fresh_GBps"] = _rate(nbytes, reg_fresh)
        res["unregister_GBps"] = _rate(nbytes, unreg)
        res["register_call_s"] = register_call_seconds(dev, calls=calls, repeats=repeats)

        res["first_touch_GBps"] = []
        for t in sorted({1, threads[-1]}):
            runs = []
            for i in range(repeats + 1):
                fresh_arr = np.empty(nbytes, np.uint8)
                seconds = parallel(t, lambda a, b, arr=fresh_arr: arr[a:b].fill(1))
                if i:
                    runs.append(seconds)
                del fresh_arr
            res["first_touch_GBps"].append([t, _rate(nbytes, runs)])

        staging_pass()
        res["staging_GBps"] = [[t, (staging_bytes // 2) / max(staging_s[t], 1e-9) / 1e9] for t in threads]
    finally:
        executor.shutdown(wait=True)
        s.sync()
        if s_out is not None:
            s_out.sync()
        for obj in (pool, spin, d_a, d_b, h_pin, st_da, st_db, st_in, st_out, s_out, s):
            if obj is not None:
                obj.close()
    res["seconds"] = time.perf_counter() - t_start
    return res


def staging_buffers(dev: Any, stream: Any, nbytes: int, least: int) -> tuple[int, tuple]:
    """The staging measurement's memory: two pinned buffers of ``nbytes`` (in, out), two device
    buffers of half that (allocated in ``stream``'s order) and a touched pageable source of
    ``nbytes``. Where the host or the device has too little memory for them (a MemoryError,
    which :class:`~ringflow._errors.OutOfMemoryError` is), half as many bytes, down to ``least``.

    Returns:
        ``(the bytes taken, (h_in, h_out, d_a, d_b, src))``.

    Raises:
        MemoryError: not even ``least`` bytes (the last allocation's error); nothing made is
            left open.
    """
    while True:
        made: list = []
        try:
            made.append(dev.allocate_host(nbytes))
            made.append(dev.allocate_host(nbytes))
            made.append(dev.allocate(nbytes // 2, stream=stream))
            made.append(dev.allocate(nbytes // 2, stream=stream))
            src = np.empty(nbytes, np.uint8)
            src.fill(0x5A)  # touched, as a caller's array is
            return nbytes, (*made, src)
        except BaseException as exc:
            for obj in reversed(made):
                close_quietly(obj, "a staging measurement buffer")
            if not isinstance(exc, MemoryError) or nbytes // 2 < least:
                raise
        nbytes //= 2


def staging_splits(threads: int) -> tuple[int, ...]:
    """How many of ``threads`` copy in (the rest copy out) in the staging measurement: half,
    three in eight (the copy out also faults the fresh pages in, so more threads may pay there),
    and all of them, each copying its part in and then out by turns (no thread idles while
    another's copy runs long, as in the staged path, whose workers take either kind of task)."""
    if threads < 2:
        return (1,)
    return tuple(sorted({threads // 2, max(1, 3 * threads // 8), threads}))


def staging_runs(s_in: Any, s_out: Any, d_a: Any, d_b: Any, h_in: Any, h_out: Any, src: np.ndarray, executor: Any,
                 t_in: int, t_out: int, repeats: int, chunk_bytes: int = 0) -> list[float]:
    """Seconds of ``repeats`` runs (after a warm-up) of the staged path's memory work at once
    (``staging_GBps`` of :func:`measure_model`): ``t_in`` threads copy ``src.nbytes / 2`` of
    ``src`` into pinned memory while ``t_out`` threads copy as many bytes of pinned memory into
    fresh pages and the device copies as many bytes each way; with ``t_out`` 0 each of the
    ``t_in`` threads copies its part in and then out (one task per thread in every case: one
    worker stages chunks in and results out by turns). ``h_in`` and ``h_out`` are pinned
    buffers of ``src.nbytes``: the first half of each is the host copies', the second half the
    device copies' (no byte is written by one while the other reads it). The host copies are
    numpy's (``np.copyto`` on the calling thread), as the staged path's workers make them: a
    chunk's rows into its pinned slot, a result's rows out of it. Not ringflow's native copy,
    whose streaming stores serve a request's staging (:meth:`Device.host_copy`): timed here in
    its place, it would give the planner a rate the staged path does not copy at.

    ``chunk_bytes`` (with ``t_out`` 0): the copies go in chunks of that many bytes through a
    ring of pinned slots (two a thread, four at the least), thread ``i`` taking chunks ``i``,
    ``i + t_in``, ... and copying each in and then out, as the staged path's workers take chunk
    tasks through its slots (for comparing the two ways: ``bench/staging_rate_check.py
    --chunk-mib``; the doctor times whole parts)."""
    half = src.nbytes // 2
    pin_in, pin_out = h_in.view(np.uint8), h_out.view(np.uint8)
    dma_from, dma_into = h_in.slice(half, half), h_out.slice(half, half)
    dev_in, dev_out = d_a.slice(0, half), d_b.slice(0, half)

    def copy_in_then_out(fresh: np.ndarray, a: int, b: int) -> None:
        np.copyto(pin_in[a:b], src[a:b])
        np.copyto(fresh[a:b], pin_out[a:b])

    def parts(t: int) -> list[tuple[int, int]]:
        step = -(-half // max(1, t))
        return [(a, min(a + step, half)) for a in range(0, half, step)]

    if chunk_bytes and t_out:
        raise ValueError(f"chunk_bytes: chunks are copied in and then out by the same thread, so t_out must be 0, "
                         f"got {t_out}")
    chunks = [(a, min(a + chunk_bytes, half)) for a in range(0, half, chunk_bytes)] if chunk_bytes else []
    slots = min(max(4, 2 * t_in), len(chunks))

    def chunks_in_then_out(fresh: np.ndarray, first: int) -> None:
        for k in range(first, len(chunks), t_in):
            a, b = chunks[k]
            at = (k % slots) * chunk_bytes
            np.copyto(pin_in[at:at + b - a], src[a:b])
            np.copyto(fresh[a:b], pin_out[at:at + b - a])

    runs = []
    for i in range(repeats + 1):
        fresh = np.empty(half, np.uint8)  # new pages, as a new output array has
        s_in.sync()
        s_out.sync()
        t0 = time.perf_counter()
        s_in.copy(dev_in, dma_from)
        s_out.copy(dma_into, dev_out)
        if t_out:
            futures = ([executor.submit(np.copyto, pin_in[a:b], src[a:b]) for a, b in parts(t_in)]
                       + [executor.submit(np.copyto, fresh[a:b], pin_out[a:b]) for a, b in parts(t_out)])
        elif chunks:
            futures = [executor.submit(chunks_in_then_out, fresh, i) for i in range(t_in)]
        else:  # each thread copies its part in and then out, as one worker stages by turns
            futures = [executor.submit(copy_in_then_out, fresh, a, b) for a, b in parts(t_in)]
        for f in futures:
            f.result()
        s_in.sync()
        s_out.sync()
        if i:  # the first run warms the threads, the pages and the copy path
            runs.append(time.perf_counter() - t0)
        del fresh
    return runs


def _rate(nbytes: int, seconds: list[float]) -> float:
    """GB/s of ``nbytes`` in the median of ``seconds`` (a clock's tick at the least: a call too
    quick to time reads as very fast, not as a division by zero)."""
    return nbytes / max(statistics.median(seconds), 1e-9) / 1e9


def _nothing() -> None:
    """An empty host task."""
