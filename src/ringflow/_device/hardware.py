"""Named performance profiles for the simulated GPU.

``h200-pcie5`` is built from the figures measured on our H200 (DESIGN.md section 6): pinned
copies by size, both directions at once, pageable copies, launch overhead, host copy rates.
A copy of ``n`` bytes takes ``n / bandwidth(n)``, the bandwidth read off the measured
bandwidth-by-size curve (log-log interpolation), so small copies are as slow as measured.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Any

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    name: str
    # (bytes, GB/s) points of a pinned copy's bandwidth by size, one direction alone.
    h2d_curve: tuple[tuple[int, float], ...]
    d2h_curve: tuple[tuple[int, float], ...]
    duplex_GBps: float  # H2D + D2H together, when both run at once (they share the link)
    pageable_h2d_GBps: float
    pageable_d2h_GBps: float
    device_GBps: float  # device memory, counting bytes read plus written (memory-bound kernels)
    kernel_min_s: float  # the shortest a kernel takes on the device
    launch_overhead_s: float  # host time to enqueue a kernel
    copy_overhead_s: float  # host time to enqueue a copy
    event_overhead_s: float  # host time to record / query an event or wait on one
    host_copy_GBps: tuple[tuple[int, float], ...]  # (threads, GB/s) pageable -> pinned memcpy
    host_task_overhead_s: float  # scheduling cost of one host task
    register_GBps: float  # cudaHostRegister of memory already touched
    register_fresh_GBps: float  # cudaHostRegister of never-touched memory (it faults pages in)
    unregister_GBps: float
    first_touch_GBps: tuple[tuple[int, float], ...]  # (threads, GB/s) first write to fresh pages
    async_engine_count: int
    sm_count: int
    compute_capability: tuple[int, int]
    total_memory: int
    chaos_spread: float = 0.25  # with chaos on, durations vary by up to this fraction
    pcie_link: "tuple[float, int] | None" = None  # (GT/s per lane, lanes) of the GPU's host link, if known

    def copy_GBps(self, direction: str, nbytes: int) -> float:
        """Bandwidth of one pinned copy of ``nbytes`` running alone (direction 'h2d' or 'd2h')."""
        curve = self.h2d_curve if direction == "h2d" else self.d2h_curve
        return _interp_loglog(curve, nbytes)

    def host_copy_rate(self, threads: int) -> float:
        """GB/s of host memcpy with ``threads`` threads copying at once (all threads together)."""
        return _interp_loglog(self.host_copy_GBps, max(1, threads))

    def first_touch_rate(self, threads: int) -> float:
        return _interp_loglog(self.first_touch_GBps, max(1, threads))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _interp_loglog(points: tuple[tuple[int, float], ...], x: float) -> float:
    xs = [p[0] for p in points]
    if x <= xs[0]:
        # below the first measured size the copy is latency-bound: time stays ~constant
        return points[0][1] * x / xs[0]
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect.bisect_right(xs, x) - 1
    (x0, y0), (x1, y1) = points[i], points[i + 1]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


H200_PCIE5 = HardwareProfile(
    name="h200-pcie5",
    h2d_curve=((64 * KiB, 2.5), (256 * KiB, 10.4), (1 * MiB, 26.8), (4 * MiB, 43.1), (16 * MiB, 49.4),
               (256 * MiB, 54.8)),
    d2h_curve=((64 * KiB, 2.5), (256 * KiB, 10.4), (1 * MiB, 26.8), (4 * MiB, 43.1), (16 * MiB, 49.4),
               (256 * MiB, 54.7)),
    duplex_GBps=98.4,
    pageable_h2d_GBps=15.9,
    pageable_d2h_GBps=11.3,
    device_GBps=4300.0,
    kernel_min_s=2.0e-6,
    launch_overhead_s=11.0e-6,
    copy_overhead_s=4.0e-6,
    event_overhead_s=1.0e-6,
    host_copy_GBps=((1, 10.0), (4, 21.0), (8, 31.4), (16, 41.1)),
    host_task_overhead_s=5.0e-6,
    register_GBps=GiB / 34e-3 / 1e9,
    register_fresh_GBps=GiB / 140e-3 / 1e9,
    unregister_GBps=GiB / 21e-3 / 1e9,
    first_touch_GBps=((1, GiB / 284e-3 / 1e9), (16, GiB / 34e-3 / 1e9)),
    async_engine_count=3,
    sm_count=132,
    compute_capability=(9, 0),
    total_memory=141 * 10**9,
    pcie_link=(32.0, 16),  # PCIe Gen5 x16
)

# A small, round-numbered profile for tests whose expected values are computed by hand:
# 1 GB/s copies of any size, 2 GB/s when both directions run, no host overheads.
UNIT_TEST = HardwareProfile(
    name="unit",
    h2d_curve=((1, 1.0), (1 << 40, 1.0)),
    d2h_curve=((1, 1.0), (1 << 40, 1.0)),
    duplex_GBps=2.0,
    pageable_h2d_GBps=0.5,
    pageable_d2h_GBps=0.5,
    device_GBps=10.0,
    kernel_min_s=0.0,
    launch_overhead_s=0.0,
    copy_overhead_s=0.0,
    event_overhead_s=0.0,
    host_copy_GBps=((1, 1.0), (2, 2.0), (4, 4.0), (8, 8.0), (16, 16.0)),
    host_task_overhead_s=0.0,
    register_GBps=1.0,
    register_fresh_GBps=0.5,
    unregister_GBps=1.0,
    first_touch_GBps=((1, 1.0), (16, 16.0)),
    async_engine_count=2,
    sm_count=1,
    compute_capability=(0, 0),
    total_memory=1 << 34,
    chaos_spread=0.25,
)

PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (H200_PCIE5, UNIT_TEST)}


def get_profile(profile: "str | HardwareProfile") -> HardwareProfile:
    if isinstance(profile, HardwareProfile):
        return profile
    try:
        return PROFILES[profile]
    except KeyError:
        raise ValueError(f"unknown sim profile {profile!r}; choose one of {sorted(PROFILES)} "
                         "or pass a HardwareProfile") from None
