"""Why the submitting thread falls behind its arrivals: the ``requests`` workload's pipeline
(as ``ringflow bench`` builds it), its capacity measured closed loop, then ``--rounds`` open-loop
levels at ``--load`` of that capacity with every ``submit`` and every wait for an arrival timed:

* per request: how far behind its arrival ``submit`` began (``behind``), ``submit``'s wall
  time, its thread CPU time, and the thread's page faults and context switches inside it
  (``getrusage(RUSAGE_THREAD)``); ``submit``'s median time split between requests that arrived
  while the thread waited (on time) and those that arrived while it was busy (behind);
* per wait for an arrival: how late it returned (``late``: the thread slept past the arrival);
* the garbage collector's pauses, with their times, and every block the host pool pinned
  during the level (when, how long, its size, on which thread);
* with ``--sample`` (a second pass of every round), a thread that every 0.5 ms notes how late
  it woke (a thread that cannot get the GIL wakes late) and the innermost frames of every
  other thread.

A stall is a run of requests each submitted more than ``--behind-ms`` after its arrival; for each
one the report sums what the submitting thread did in it (``submit`` wall and CPU time, faults,
switches, late wake-ups, collector pauses) and, when sampled, the frames seen most often.
Also the submitting thread's busy share of the level (``submit`` wall over the level): a
share near 1 means the thread, not the GPU, sets the pace at that load.

    PYTHONPATH=src python3 bench/request_stalls.py --device cuda:0 --rounds 3 --sample --out stalls.json
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import resource
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from ringflow._bench import baselines, kernels, workloads  # noqa: E402
from ringflow._bench.stacks import current_frames  # noqa: E402
from ringflow._device import host_pool  # noqa: E402
from _script import header, write  # noqa: E402

MiB = 1 << 20
USAGE = ("ru_minflt", "ru_majflt", "ru_nvcsw", "ru_nivcsw")


def _usage() -> tuple:
    u = resource.getrusage(resource.RUSAGE_THREAD)
    return tuple(getattr(u, k) for k in USAGE)


class _Sampler(threading.Thread):
    """Every ``period`` seconds: how late this thread woke, and the innermost ``depth`` frames of
    every other thread (by thread name)."""

    def __init__(self, clock, period: float = 5e-4, depth: int = 3):
        super().__init__(name="stall-sampler", daemon=True)
        self.clock, self.period, self.depth = clock, period, depth
        self.samples: list = []
        self._halt = threading.Event()

    def run(self) -> None:
        names = {}
        me = threading.get_ident()
        due = self.clock() + self.period
        while not self._halt.is_set():
            time.sleep(max(0.0, due - self.clock()))
            now = self.clock()
            frames = current_frames()
            if len(names) != len(frames):
                names = {t.ident: t.name for t in threading.enumerate()}
            stacks = {}
            for ident, f in frames.items():
                if ident == me:
                    continue
                parts = []
                while f is not None and len(parts) < self.depth:
                    parts.append(f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}:{f.f_lineno}")
                    f = f.f_back
                stacks[names.get(ident, str(ident))] = " < ".join(parts)
            self.samples.append((now, now - due, stacks))
            due = max(due + self.period, now)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def _gc_times(clock):
    """A collector callback and the list of ``(start, seconds)`` it fills."""
    pauses, start = [], []

    def cb(phase, info):
        if phase == "start":
            start.append(clock())
        elif start:
            t0 = start.pop()
            pauses.append((t0, clock() - t0))
    return cb, pauses


def run_level(pipe, dev, items, gaps, *, sample: bool, behind_ms: float, main_name: str) -> dict:
    clock = lambda: dev.now  # noqa: E731
    server = workloads.PipelineServer(pipe, dev)
    n = len(items)
    server.reset(n)
    enter, leave, cpu = np.zeros(n), np.zeros(n), np.zeros(n)
    usage = np.zeros((n, len(USAGE)))
    waits: list = []  # (target, returned)

    def submit(i):
        u0, c0, t0 = _usage(), time.thread_time(), clock()
        server.submit(i, items[i])
        t1, c1, u1 = clock(), time.thread_time(), _usage()
        enter[i], leave[i], cpu[i] = t0, t1, c1 - c0
        usage[i] = np.subtract(u1, u0)

    def advance(t):
        server.advance(t)
        waits.append((t, clock()))

    for i, it in enumerate(items[:30]):  # warm-up, as the workload does before each level
        server.submit(i, it)
    server.drain()
    server.reset(n)
    sampler = _Sampler(clock) if sample else None
    pool0 = rf.host.stats(device=dev)
    pool = host_pool.pool_for(dev)
    allocating = pool._allocate
    pinned: list = []  # (start, seconds, bytes, thread) of each block the pool pinned in the level

    def timed_allocate(size, claim):
        t0 = clock()
        allocating(size, claim)
        pinned.append((t0, clock() - t0, size, threading.current_thread().name))
    pool._allocate = timed_allocate
    cb, pauses = _gc_times(clock)
    gc.callbacks.append(cb)
    if sampler:
        sampler.start()
    try:
        arrived, _ = baselines.open_loop(clock, gaps, submit, advance)
        server.drain()
    finally:
        del pool._allocate
        gc.callbacks.remove(cb)
        if sampler:
            sampler.stop()
    pool1 = rf.host.stats(device=dev)
    lat = server.done - arrived
    correct = all(r is not None and np.array_equal(r, it * np.float32(2) + np.float32(1))
                  for r, it in zip(server.results, items))
    behind = enter - arrived
    wall = leave - enter
    span = leave[-1] - arrived[0] + gaps[0]
    w_target = np.array([w[0] for w in waits])
    w_late = np.array([max(0.0, w[1] - w[0]) for w in waits])
    stalls = []
    i = 0
    while i < n:
        if behind[i] * 1e3 <= behind_ms:
            i += 1
            continue
        j = i
        while j + 1 < n and behind[j + 1] * 1e3 > behind_ms:
            j += 1
        lo, hi = (enter[i - 1] if i else arrived[0]), leave[j]
        sel = slice(i, j + 1)
        in_win = (w_target >= lo) & (w_target <= hi)
        st = {"first": i, "requests": j - i + 1, "from_ms": 1e3 * float(lo - arrived[0]), "to_ms": 1e3 * float(hi - arrived[0]),
              "behind_max_ms": 1e3 * float(behind[sel].max()),
              "window_ms": 1e3 * float(hi - lo),
              "submit_wall_ms": 1e3 * float(wall[sel].sum()), "submit_cpu_ms": 1e3 * float(cpu[sel].sum()),
              "submit_wall_max_ms": 1e3 * float(wall[sel].max()),
              "bytes": int(sum(items[k].nbytes for k in range(i, j + 1))),
              **{k[3:]: int(usage[sel, m].sum()) for m, k in enumerate(USAGE)},
              "prior_submit_ms": 1e3 * float(wall[i - 1]) if i else None,
              "wait_late_ms": 1e3 * float(w_late[in_win].sum()),
              "gc_ms": 1e3 * sum(d for t, d in pauses if lo <= t <= hi),
              "pinned_ms": 1e3 * sum(d for t, d, _, _ in pinned if lo <= t <= hi)}
        if sampler:
            inside = [s for s in sampler.samples if lo <= s[0] <= hi]
            st["sampler_late_max_ms"] = 1e3 * max((s[1] for s in inside), default=0.0)
            top = collections.Counter()
            for s in inside:
                for name, stack in s[2].items():
                    top[f"{name}: {stack}"] += 1
            st["samples"] = len(inside)
            st["frames"] = top.most_common(8)
        stalls.append(st)
        i = j + 1
    stalls.sort(key=lambda s: -s["behind_max_ms"])
    out = {"sampled": sample, "correct": bool(correct), "p50_ms": 1e3 * float(np.percentile(lat, 50)),
           "p99_ms": 1e3 * float(np.percentile(lat, 99)),
           "behind_p50_ms": 1e3 * float(np.percentile(behind, 50)), "behind_p99_ms": 1e3 * float(np.percentile(behind, 99)),
           "submit_wall_p50_ms": 1e3 * float(np.percentile(wall, 50)), "submit_wall_p99_ms": 1e3 * float(np.percentile(wall, 99)),
           "submit_wall_max_ms": 1e3 * float(wall.max()),
           # submit's wall and CPU time for requests the thread waited for (it was idle when they
           # arrived) against those that arrived while it was still busy with earlier ones
           **_by_arrival(behind, wall, cpu, behind_ms=0.05),
           "submit_cpu_over_wall": float(cpu.sum() / wall.sum()),
           # the submitting thread's share of the level spent inside submit
           "submit_busy_share": float(wall.sum() / span),
           "wait_late_p99_ms": 1e3 * float(np.percentile(w_late, 99)), "wait_late_max_ms": 1e3 * float(w_late.max()),
           "gc_pauses": len(pauses), "gc_max_ms": 1e3 * max((d for _, d in pauses), default=0.0),
           "usage_totals": {k[3:]: int(usage[:, m].sum()) for m, k in enumerate(USAGE)},
           # blocks the pool pinned (or fell back to pageable memory for) during the level
           "pool_during_level": {k: getattr(pool1, k) - getattr(pool0, k) for k in ("allocations", "hits", "fallbacks")},
           "pool_cached_MiB": pool1.cached_bytes / MiB, "pool_in_use_MiB": pool1.in_use_bytes / MiB,
           "pinned_in_level": [{"at_ms": 1e3 * float(t - arrived[0]), "ms": 1e3 * d, "MiB": n / MiB, "thread": th}
                               for t, d, n, th in pinned],
           "stalls": len(stalls), "stall_requests": int(sum(s["requests"] for s in stalls)), "worst": stalls[:6]}
    if sampler:
        lates = np.array([s[1] for s in sampler.samples])
        out["sampler_late_p99_ms"] = 1e3 * float(np.percentile(lates, 99)) if len(lates) else None
        out["sampler_late_max_ms"] = 1e3 * float(lates.max()) if len(lates) else None
        whole = collections.Counter()
        for s in sampler.samples:
            for name, stack in s[2].items():
                if name in (main_name,) or "progress" in name.lower() or "ringflow" in name.lower():
                    whole[f"{name}: {stack}"] += 1
        out["frames_whole_level"] = whole.most_common(12)
    return out


def _by_arrival(behind, wall, cpu, *, behind_ms: float) -> dict:
    """The median ``submit`` wall time (ms) and CPU over wall of the requests submitted within
    ``behind_ms`` of their arrival (``on_time``) and of those submitted later (``behind``), with
    how many of each."""
    out = {}
    for name, sel in (("on_time", behind * 1e3 <= behind_ms), ("behind", behind * 1e3 > behind_ms)):
        k = int(sel.sum())
        out[f"submit_{name}"] = {"requests": k,
                                 "wall_p50_ms": 1e3 * float(np.median(wall[sel])) if k else None,
                                 "cpu_over_wall": float(cpu[sel].sum() / wall[sel].sum()) if k else None}
    return out


def pin_submitter() -> dict:
    """Keep the calling (submitting) thread on one CPU of those it may use, and every other
    thread of the process (the progress thread, copy threads, workers) on the rest: a test of
    whether sharing a CPU with them is what slows ``submit`` in some rounds. Returns the CPUs
    each side got and how many other threads were moved. Threads started later inherit the
    starting thread's CPUs, so call it once the pipeline runs."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {"submitter": cpus, "others": cpus, "moved_threads": 0}
    mine, rest = cpus[-1], set(cpus[:-1])
    os.sched_setaffinity(0, {mine})  # 0: the calling thread
    me = threading.get_native_id()
    moved = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != me:
            try:
                os.sched_setaffinity(int(tid), rest)
                moved += 1
            except OSError:  # the thread ended meanwhile
                pass
    return {"submitter": [mine], "others": sorted(rest), "moved_threads": moved}


def first_pass(server, items) -> None:
    """Every request once through ``server`` (a ``PipelineServer``), untimed: the pool's blocks
    pinned before anything is measured."""
    server.reset(len(items))
    for i, it in enumerate(items):
        server.submit(i, it)
    server.drain()


def capacity_passes(server, dev, items, passes: int = 3) -> list:
    """Closed-loop passes of every request through ``server``; returns each pass's requests a
    second (the results dropped after each)."""
    rates = []
    for _ in range(passes):
        server.reset(len(items))
        t0 = dev.now
        for i, it in enumerate(items):
            server.submit(i, it)
        server.drain()
        rates.append(len(items) / (dev.now - t0))
    server.reset(len(items))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sample", action="store_true", help="also run every round with the sampler")
    ap.add_argument("--behind-ms", type=float, default=1.0)
    ap.add_argument("--pin", action="store_true",
                    help="once the pipeline runs, keep the submitting thread on one CPU and every other thread "
                         "of the process off it")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    items, _ = workloads.request_items(args.count, 8 * MiB)
    result = {**header(str(dev)), "count": args.count, "load": args.load,
              "copy_streaming": os.environ.get("RINGFLOW_COPY_STREAMING", "1") != "0", "rounds": []}
    main_name = threading.current_thread().name
    with rf.Pipeline(kernels.scale_shift(), device=dev, chunk_bytes=8 * MiB) as pipe:
        server = workloads.PipelineServer(pipe, dev)
        first_pass(server, items)
        if args.pin:
            result["pinned_cpus"] = pin_submitter()
            print("pinned", result["pinned_cpus"], flush=True)
        rates = capacity_passes(server, dev, items)
        capacity = statistics.median(rates)
        iso = []
        for i, it in enumerate(items):
            t0 = dev.now
            pipe.submit(it).result()
            iso.append(dev.now - t0)
        result.update(capacity_per_s=capacity, passes_per_s=rates, isolated_p99_ms=1e3 * float(np.percentile(iso, 99)))
        print(f"capacity {capacity:.0f}/s (passes {[round(r) for r in rates]}), isolated p99 "
              f"{result['isolated_p99_ms']:.2f} ms", flush=True)
        rng = np.random.default_rng(11)
        for r in range(args.rounds):
            gaps = rng.exponential(1.0 / (args.load * capacity), len(items))
            for sample in ((False, True) if args.sample else (False,)):
                lv = run_level(pipe, dev, items, gaps, sample=sample, behind_ms=args.behind_ms, main_name=main_name)
                lv["round"] = r
                lv["p99_over_isolated"] = lv["p99_ms"] / result["isolated_p99_ms"]
                floor = baselines.queue_floor(np.cumsum(gaps), np.array(iso), [it.nbytes for it in items], capacity)
                lv["perfect_fifo_p99_ms"] = [1e3 * float(np.percentile(f, 99)) for f in floor]
                result["rounds"].append(lv)
                print(f"round {r}{' sampled' if sample else ''}: " + ", ".join(
                    f"{k} {lv[k]:.3g}" if isinstance(lv[k], float) else f"{k} {lv[k]}"
                    for k in ("correct", "p99_ms", "p99_over_isolated", "behind_p99_ms", "submit_wall_p99_ms",
                              "submit_wall_max_ms", "submit_busy_share", "submit_cpu_over_wall", "wait_late_max_ms",
                              "gc_pauses", "gc_max_ms", "stalls", "stall_requests")), flush=True)
                print("  perfect FIFO p99 ms", [round(x, 2) for x in lv["perfect_fifo_p99_ms"]], "usage", lv["usage_totals"],
                      "pool", lv["pool_during_level"], "pinned", lv["pinned_in_level"], flush=True)
                for st in lv["worst"][:3]:
                    print("  stall", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in st.items()
                                      if k != "frames"}, flush=True)
                    for fr in st.get("frames", [])[:6]:
                        print("     ", fr, flush=True)
    write(result, args.out)


if __name__ == "__main__":
    main()
