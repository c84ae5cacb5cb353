"""Where the submitting thread's time goes in a request stream: the ``requests`` workload's
items through one ``Pipeline``, closed loop (1000 requests a pass, three passes), on the device
given. Three parts:

* ``locks``: the driver's lock wrapped in a timing lock: how long the submitting thread waits
  for it and how long the progress thread holds it, per request;
* ``ab``: items joining a shared chunk with the scheduler's batch lock alone (``after``) against
  the same calls made under the driver's lock as well (``before``, how the code was), the two
  interleaved in one process, against the hand-written torch pinned ring of the same run;
* ``events``: shared items' computes without an event each (a real GPU reports nothing on
  them, ``after``) against with one each (``before``), interleaved as ``ab`` is;
* ``spin``: the CUDA device's waits polling 0.2 ms before they sleep (``before``) against
  5 ms, the default (``after``), interleaved as ``ab`` is;
* ``sections``: the submitting thread's wall and CPU time per request in each part of
  ``submit`` (the result's pool array, joining, the copy, ...), then the pool's ``take`` alone.

    PYTHONPATH=src python3 bench/submit_costs.py --part ab --device cuda:0 --out ab.json
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from ringflow._bench import baselines, kernels  # noqa: E402
from ringflow._device import host_pool  # noqa: E402
from pinned_results_check import request_items  # noqa: E402
from request_costs import cpu_seconds  # noqa: E402
from _script import header, write  # noqa: E402

MiB = 1 << 20


class TimedRLock:
    """An RLock that counts, per thread, the seconds spent waiting for it and holding it."""

    def __init__(self):
        self._lock = threading.RLock()
        self.wait, self.hold = collections.defaultdict(float), collections.defaultdict(float)
        self.slow, self.fast = collections.Counter(), collections.Counter()
        self._since, self._depth = {}, collections.Counter()

    def acquire(self, blocking=True, timeout=-1):
        me = threading.get_ident()
        if self._lock.acquire(False):
            self.fast[me] += 1
        else:
            t = time.perf_counter()
            if not self._lock.acquire(blocking, timeout):
                return False
            self.wait[me] += time.perf_counter() - t
            self.slow[me] += 1
        if self._depth[me] == 0:
            self._since[me] = time.perf_counter()
        self._depth[me] += 1
        return True

    __enter__ = acquire

    def release(self):
        me = threading.get_ident()
        self._depth[me] -= 1
        if self._depth[me] == 0:
            self.hold[me] += time.perf_counter() - self._since[me]
        self._lock.release()

    def __exit__(self, *exc):
        self.release()

    def _is_owned(self):
        return self._lock._is_owned()

    def _release_save(self):
        me = threading.get_ident()
        depth, self._depth[me] = self._depth[me], 0
        self.hold[me] += time.perf_counter() - self._since[me]
        return self._lock._release_save(), depth

    def _acquire_restore(self, state):
        me = threading.get_ident()
        self._lock._acquire_restore(state[0])
        self._depth[me], self._since[me] = state[1], time.perf_counter()

    def clear(self):
        for d in (self.wait, self.hold, self.slow, self.fast):
            d.clear()


def under_driver_lock(pipe) -> None:
    """Make joining a shared chunk and ending a copy into it take the driver's lock too."""
    d, s = pipe._driver, pipe._sched
    join, written = s.join_open_batch, s.member_written

    def joined(driver, result):
        with d.cv:
            return join(driver, result)

    def ended(chunk, member, span):
        with d.cv:
            written(chunk, member, span)
            d.notify()

    s.join_open_batch, s.member_written = joined, ended


def timed_calls(acc: dict, cnt: collections.Counter, name: str, fn):
    """``fn``, adding its wall and CPU seconds on the main thread to ``acc`` under ``name``."""
    def call(*a, **k):
        if threading.current_thread() is not threading.main_thread():
            return fn(*a, **k)
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t
            acc[name + "_cpu"] += time.thread_time() - c
            cnt[name] += 1
    return call


def passes(dev, items, count: int, setup=None, each=None) -> list:
    """A pipeline over ``items``: an untimed pass, then ``count`` timed closed-loop passes, each
    checked; ``setup(pipe)`` runs first, ``each(pipe, n)`` after each pass for more figures."""
    f = kernels.scale_shift()
    rows = []
    with rf.Pipeline(f, device=dev, chunk_bytes=8 * MiB) as pipe:
        extra = setup(pipe) if setup else None
        for fu in [pipe.submit(it) for it in items]:
            fu.result()
        prog, me = pipe._driver.thread.ident, threading.get_ident()
        for _ in range(count):
            if extra is not None:
                extra.clear()
            c0 = pipe.scheduler.chunks_admitted
            p0, s0, t0 = cpu_seconds(prog), cpu_seconds(me), time.perf_counter()
            futs = [pipe.submit(it) for it in items]
            res = [fu.result() for fu in futs]
            wall, n = time.perf_counter() - t0, len(items)
            row = {"per_s": n / wall, "wall_us": 1e6 * wall / n,
                   "progress_cpu_us": 1e6 * (cpu_seconds(prog) - p0) / n,
                   "submit_cpu_us": 1e6 * (cpu_seconds(me) - s0) / n,
                   "items_per_chunk": n / max(1, pipe.scheduler.chunks_admitted - c0),
                   "correct": all(np.array_equal(r, it * np.float32(2) + np.float32(1)) for r, it in zip(res, items))}
            if each:
                row.update(each(pipe, n, extra, prog, me))
            del res, futs
            rows.append(row)
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


def part_locks(dev, items) -> dict:
    def setup(pipe):
        lock = TimedRLock()
        d = pipe._driver
        with d.cv:
            d.cv = threading.Condition(lock)
        time.sleep(0.2)  # the progress thread's turn in progress ends on the old lock
        return lock

    def each(pipe, n, lock, prog, me):
        return {"submit_lock_wait_us": 1e6 * lock.wait[me] / n, "submit_slow_acquires": lock.slow[me] / n,
                "progress_lock_hold_us": 1e6 * lock.hold[prog] / n, "progress_lock_wait_us": 1e6 * lock.wait[prog] / n}

    return {"plain": passes(dev, items, 3), "timed": passes(dev, items, 3, setup, each)}


def every_item_an_event(pipe) -> None:
    """Record an event after each shared item's compute, as on a device whose launches report
    their errors on events (the simulated GPU), to measure what skipping them buys."""
    type(pipe.device).launch_errors_on_events = True


def interleaved(dev, items, before, undo=None, rounds: int = 3) -> dict:
    """``rounds`` rounds of a ``before`` pipeline (``before(pipe)`` sets it up, ``undo()`` puts
    back what it changed beyond the pipeline) and a plain one (``after``), their order
    alternating, three passes each."""
    out = {"runs": []}
    default = type(dev).launch_errors_on_events
    for r in range(rounds):
        for is_before in ((False, True) if r % 2 else (True, False)):
            try:
                rows = passes(dev, items, 3, before if is_before else None)
            finally:
                type(dev).launch_errors_on_events = default
                if undo is not None:
                    undo()
            med = {k: statistics.median(x[k] for x in rows) for k in rows[0] if k != "correct"}
            out["runs"].append({"variant": "before" if is_before else "after", "passes": rows, "median": med,
                                "correct": all(x["correct"] for x in rows)})
    for v in ("before", "after"):
        out[f"{v}_per_s"] = [x["median"]["per_s"] for x in out["runs"] if x["variant"] == v]
    return out


def short_spin(pipe) -> None:
    """The CUDA device's waits poll with yields for 0.2 ms instead of 5 ms before they sleep."""
    from ringflow._device.cuda import device as cuda_device

    cuda_device._WAIT_SPIN_S = 0.0002


def part_spin(dev, items) -> dict:
    from ringflow._device.cuda import device as cuda_device

    default = cuda_device._WAIT_SPIN_S
    return interleaved(dev, items, short_spin, lambda: setattr(cuda_device, "_WAIT_SPIN_S", default))


def part_ab(dev, items) -> dict:
    return interleaved(dev, items, under_driver_lock)


def part_events(dev, items) -> dict:
    return interleaved(dev, items, every_item_an_event)


def part_sections(dev, items) -> dict:
    acc, cnt = collections.defaultdict(float), collections.Counter()

    def setup(pipe):
        s = pipe._sched
        pipe._pool.take = timed_calls(acc, cnt, "pool.take", pipe._pool.take)
        for name in ("join_open_batch", "open_new_batch", "member_written"):
            setattr(s, name, timed_calls(acc, cnt, name, getattr(s, name)))
        dev.host_copy = timed_calls(acc, cnt, "host_copy", dev.host_copy)
        for name in ("_check_item", "_shares_chunk", "_wait_for_capacity", "submit"):
            setattr(pipe, name, timed_calls(acc, cnt, name, getattr(pipe, name)))
        return _Clear(acc, cnt)

    def each(pipe, n, extra, prog, me):
        return {**{f"{k}_us": 1e6 * v / n for k, v in acc.items()}, **{f"{k}_calls": c / n for k, c in cnt.items()}}

    out = {"passes": passes(dev, items, 3, setup, each)}
    pool = host_pool.pool_for(dev)
    shape, dt = (400_000,), np.dtype(np.float32)
    for _ in range(50):
        a = pool.take(shape, dt)
        del a
    t = time.perf_counter()
    for _ in range(2000):
        a = pool.take(shape, dt)
        del a
    out["take_and_drop_us"] = 1e6 * (time.perf_counter() - t) / 2000
    held = [pool.take(it.shape, it.dtype) for it in items]
    del held
    t = time.perf_counter()
    a = pool.take(shape, dt)
    out["first_take_after_1000_dropped_ms"] = 1e3 * (time.perf_counter() - t)
    del a
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        a = pool.take(shape, dt)
        del a
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
    out["take_profile"] = text.getvalue()
    return out


class _Clear:
    def __init__(self, *dicts):
        self.dicts = dicts

    def clear(self):
        for d in self.dicts:
            d.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("locks", "ab", "events", "spin", "sections"), required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--no-gc", action="store_true", help="a diagnosis: the cyclic collector off throughout")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.no_gc:
        gc.disable()
    dev = rf.device(args.device)
    items = request_items(args.count, 8 * MiB)
    result = {**header(str(dev)), "count": args.count, "part": args.part, "gc": not args.no_gc}
    result.update({"locks": part_locks, "ab": part_ab, "events": part_events, "spin": part_spin,
                   "sections": part_sections}[args.part](dev, items))
    if dev.backend == "cuda":
        expected = [it * np.float32(2) + np.float32(1) for it in items]
        ring = baselines.run_or_skip(baselines.torch_requests_ring, items, expected, loads=())
        result["torch_ring_per_s"] = ring.get("capacity_per_s")
        if args.part in ("ab", "events", "spin") and result["torch_ring_per_s"]:
            for v in ("before", "after"):
                result[f"{v}_over_ring"] = [c / result["torch_ring_per_s"] for c in result[f"{v}_per_s"]]
        print("torch ring", result["torch_ring_per_s"], flush=True)
    write(result, args.out)


if __name__ == "__main__":
    main()
