"""Measurements of a real GPU for ``ringflow doctor``: copy bandwidth and copy/compute overlap.

Rules (DESIGN.md section 5): device time comes from timing events around the region; every
figure is the median of several repeats after warm-up, reported with its spread; data is
random, never zeros; a round trip is checked bit-exact so a broken copy cannot look fast.
Pageable copies are timed with the host clock around copy + sync, since the host does the
staging.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import numpy as np

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
