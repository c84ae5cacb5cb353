"""The staging copy that ``submit`` makes, inside a live pipeline against alone, by how many
native copy threads it is split over: the ``requests`` workload's items, for each thread count
(``--threads``; the library's own is ``protocol.NATIVE_MAX_THREADS``):

* alone: every item copied into a pool array of its size by ``Device.host_copy``, one after
  another, no pipeline running (mean µs a copy);
* in the pipeline: the closed-loop capacity (three passes) with every ``host_copy`` of the
  submitting thread timed (mean wall and CPU µs a copy), then one open-loop level at
  ``--load`` of that capacity (p99, and the submitting thread's busy share, as
  ``request_stalls.py`` reports them).

With ``--streaming 1,0`` each thread count runs with the native copy's streaming stores on and
off (``native_copy.set_streaming``); ``--spin-us 200,1000`` with the copy threads polling that
long before they sleep (``native_copy.set_spin``). Variants run in turn,
``--rounds`` times, each on a fresh pipeline. Each phase also reports the native copy's counters
(parts handed to helpers, helpers handed one while asleep, the caller's wait for its helpers) and
the process's cgroup CPU throttling (``cpu.stat``) over it. Also the host's CPUs, the cgroup's
CPU quota (``cpu.max``) and how many hardware threads share a core.

    PYTHONPATH=src python3 bench/staging_in_pipeline.py --device cuda:0 --threads 2,4,8 --rounds 2 --out FILE
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from ringflow._bench import kernels, workloads  # noqa: E402
from ringflow._device import native_copy, protocol  # noqa: E402
from _script import header, write  # noqa: E402
from request_stalls import capacity_passes, first_pass, run_level  # noqa: E402

MiB = 1 << 20


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return "unknown"


def _cgroup_dir() -> str:
    """This process's cgroup (v2) directory, or "" where there is none. Inside a cgroup
    namespace /proc names a path the mount does not show: the mount's root is the cgroup."""
    raw = _read("/proc/self/cgroup")
    for line in raw.splitlines():
        if line.startswith("0::"):
            path = "/sys/fs/cgroup" + line[3:].rstrip("/")
            return path if os.path.isdir(path) else "/sys/fs/cgroup"
    return ""


def _cpu_stat() -> dict:
    """The cgroup's ``cpu.stat`` as numbers (empty where unreadable)."""
    out = {}
    for line in _read(os.path.join(_cgroup_dir() or "/sys/fs/cgroup", "cpu.stat")).splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


class _Over:
    """The native copy's counters and the cgroup's CPU throttling over a block."""

    def __enter__(self):
        self.c0, self.s0, self.t0 = native_copy.counters(), _cpu_stat(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        c1, s1 = native_copy.counters(), _cpu_stat()
        self.delta = {f"copy.{k}": c1[k] - self.c0[k] for k in c1}
        self.delta.update({f"cpu.{k}": s1[k] - self.s0.get(k, 0) for k in s1
                           if k in ("usage_usec", "nr_periods", "nr_throttled", "throttled_usec")})
        self.delta["seconds"] = time.perf_counter() - self.t0


def _siblings() -> str:
    return _read("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list")


class _Timed:
    """``Device.host_copy`` of one device class, timed on every call (wall and thread CPU)."""

    def __init__(self, cls):
        self.cls, self.orig = cls, cls.host_copy
        self.wall, self.cpu, self.nbytes = [], [], []

    def __enter__(self):
        orig, wall, cpu, nbytes = self.orig, self.wall, self.cpu, self.nbytes

        def host_copy(dev, dst, src):
            c0, t0 = time.thread_time(), time.perf_counter()
            orig(dev, dst, src)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            nbytes.append(dst.nbytes)
        self.cls.host_copy = host_copy
        return self

    def __exit__(self, *exc):
        self.cls.host_copy = self.orig


def alone(dev, items) -> dict:
    dsts = {}
    times = []
    with _Over() as over:
        for it in items:
            dst = dsts.get(it.nbytes)
            if dst is None:
                dst = dsts[it.nbytes] = rf.host.empty(it.shape, it.dtype, device=dev)
            t0 = time.perf_counter()
            dev.host_copy(dst, it)
            times.append(time.perf_counter() - t0)
    return {"mean_us": 1e6 * float(np.mean(times)), "p50_us": 1e6 * float(np.median(times)),
            "GBps": sum(it.nbytes for it in items) / sum(times) / 1e9, **over.delta}


def in_pipeline(dev, items, load: float, seed: int) -> dict:
    with rf.Pipeline(kernels.scale_shift(), device=dev, chunk_bytes=8 * MiB) as pipe:
        server = workloads.PipelineServer(pipe, dev)
        first_pass(server, items)
        with _Timed(type(dev)) as timed, _Over() as closed:
            rates = capacity_passes(server, dev, items)
        capacity = statistics.median(rates)
        gaps = np.random.default_rng(seed).exponential(1.0 / (load * capacity), len(items))
        with _Timed(type(dev)) as timed_level, _Over() as level:
            lv = run_level(pipe, dev, items, gaps, sample=False, behind_ms=1.0, main_name="MainThread")
    n, m = len(timed.wall), len(timed_level.wall)
    return {"capacity_per_s": capacity, "passes_per_s": rates, "closed_loop": closed.delta, "level": level.delta,
            "level_copy_mean_us": 1e6 * sum(timed_level.wall) / max(1, m),
            "copy_mean_us": 1e6 * sum(timed.wall) / max(1, n), "copy_cpu_mean_us": 1e6 * sum(timed.cpu) / max(1, n),
            "copies": n, "copy_GBps": sum(timed.nbytes) / max(1e-12, sum(timed.wall)) / 1e9,
            "p99_80_ms": lv["p99_ms"], "behind_p99_ms": lv["behind_p99_ms"], "submit_busy_share": lv["submit_busy_share"],
            "submit_wall_p50_ms": lv["submit_wall_p50_ms"], "correct": lv["correct"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--threads", default="2,4,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streaming", default="1", help="1, 0 or 1,0: streaming stores on, off, or both in turn")
    ap.add_argument("--spin-us", default=str(round(native_copy._spin_from_env() * 1e6)),
                    help="microseconds the copy threads poll before they sleep, one or more (200,1000); the library's own by default")
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    items, _ = workloads.request_items(args.count, 8 * MiB)
    default = protocol.NATIVE_MAX_THREADS
    result = {**header(str(dev)), "cpus": os.cpu_count(), "cpu0_siblings": _siblings(),
              "cgroup": _cgroup_dir(), "cpu_max": _read(os.path.join(_cgroup_dir() or "/sys/fs/cgroup", "cpu.max")),
              "affinity_cpus": len(os.sched_getaffinity(0)),
              "library_threads": default, "count": args.count, "load": args.load, "rows": []}
    print("cpus", os.cpu_count(), "affinity", result["affinity_cpus"], "cpu.max", result["cpu_max"],
          "cpu0 siblings", result["cpu0_siblings"], "library threads", default, flush=True)
    try:
        variants = [(int(t), s == "1", float(us)) for t in args.threads.split(",")
                    for s in args.streaming.split(",") for us in args.spin_us.split(",")]
        for r in range(args.rounds):
            for t, streaming, spin_us in variants:
                protocol.NATIVE_MAX_THREADS = t
                native_copy.set_streaming(streaming)
                native_copy.set_spin(spin_us * 1e-6)
                row = {"round": r, "threads": t, "streaming": streaming, "spin_us": spin_us,
                       "alone": alone(dev, items), **in_pipeline(dev, items, args.load, seed=11 + r)}
                result["rows"].append(row)
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "passes_per_s"},
                      flush=True)
    finally:
        protocol.NATIVE_MAX_THREADS = default
        native_copy.set_streaming(True)
        native_copy.set_spin(native_copy._spin_from_env())
    write(result, args.out)


if __name__ == "__main__":
    main()
