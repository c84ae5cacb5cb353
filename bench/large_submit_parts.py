"""Where ``submit`` of a large request goes, beside a small one's: the ``requests`` workload's
items through one ``Pipeline`` (the bench's), closed loop, then open loop at ``--load`` of that
capacity, with the submitting thread's time per call in each part of ``submit``, split by item
size (over 4 MiB: a staged chunk of its own; up to 4 MiB: a place in a shared chunk):

* ``accepting``: the staging copy and pool arrays made before the lock (``_accepting``), and in
  it ``pool_take`` and ``host_copy``;
* ``lock_wait``: waiting for the driver's lock (which the progress thread keeps through a step);
* ``capacity_wait``: waiting for room once the lock is held;
* ``accept``: the scheduler's accept under the lock;
* ``submit``: the whole call; ``queue``: (open loop) arrival to entering ``submit``.

    PYTHONPATH=src python3 bench/large_submit_parts.py --device cuda:0 --out parts.json
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from ringflow._bench import kernels  # noqa: E402
from _script import header, write  # noqa: E402
from pinned_results_check import MiB, request_items  # noqa: E402
from request_costs import stamped_open_loop  # noqa: E402

LARGE = 4 * MiB


class Parts:
    """Per-call durations (seconds) of each part, by the size class of the request being submitted."""

    def __init__(self):
        self.times = {"large": collections.defaultdict(list), "small": collections.defaultdict(list)}
        self.local = threading.local()

    def cls(self) -> str | None:
        return getattr(self.local, "cls", None)

    def timed(self, name: str, fn):
        def wrapper(*a, **k):
            cls = self.cls()
            if cls is None:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.times[cls][name].append(time.perf_counter() - t0)
        return wrapper

    def summary(self) -> dict:
        out = {}
        for cls, parts in self.times.items():
            n = len(parts.get("submit", ())) or 1
            out[cls] = {name: {"calls_per_request": len(v) / n, "p50_us": 1e6 * float(np.percentile(v, 50)),
                               "p90_us": 1e6 * float(np.percentile(v, 90)), "p99_us": 1e6 * float(np.percentile(v, 99)),
                               "mean_us_per_request": 1e6 * float(np.sum(v)) / n}
                        for name, v in parts.items() if v}
        return out

    def clear(self):
        for parts in self.times.values():
            parts.clear()


def instrument(pipe, dev, parts: Parts) -> None:
    d = pipe._driver
    submit = pipe.submit

    def submit_classified(item, *a, **k):
        parts.local.cls = "large" if item.nbytes > LARGE else "small"
        try:
            return parts.timed("submit", submit)(item, *a, **k)
        finally:
            parts.local.cls = None

    pipe.submit = submit_classified
    pipe._accepting = parts.timed("accepting", pipe._accepting)
    pipe._pool.take = parts.timed("pool_take", pipe._pool.take)
    dev.host_copy = parts.timed("host_copy", dev.host_copy)
    pipe._wait_for_capacity = parts.timed("capacity_wait", pipe._wait_for_capacity)
    pipe._sched.accept = parts.timed("accept", pipe._sched.accept)
    take_lock = d.take_lock
    d.take_lock = parts.timed("lock_wait", take_lock)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    items = request_items(args.count, 8 * MiB)
    parts = Parts()
    rounds = []
    with rf.Pipeline(kernels.scale_shift(), device=dev, chunk_bytes=8 * MiB) as pipe:
        for fu in [pipe.submit(it) for it in items]:
            fu.result()
        instrument(pipe, dev, parts)
        for r in range(args.rounds):
            parts.clear()
            t0 = time.perf_counter()
            results = [fu.result() for fu in [pipe.submit(it) for it in items]]
            capacity = len(items) / (time.perf_counter() - t0)
            ok = all(np.array_equal(x, it * np.float32(2) + np.float32(1)) for x, it in zip(results, items))
            del results
            closed = parts.summary()
            parts.clear()
            gaps = np.random.default_rng(r).exponential(1.0 / (args.load * capacity), len(items))
            arrived, submitted, done = stamped_open_loop(pipe, dev, items, gaps)
            lat, queue = done - arrived, submitted - arrived
            large = np.array([it.nbytes > LARGE for it in items])
            after_large = np.zeros(len(items), bool)
            after_large[1:] = large[:-1]
            rounds.append({"round": r, "capacity_per_s": capacity, "correct": ok, "closed": closed,
                           "open": parts.summary(), "offered_per_s": args.load * capacity,
                           "p99_ms": 1e3 * float(np.nanpercentile(lat, 99)),
                           "queue_p99_ms": 1e3 * float(np.percentile(queue, 99)),
                           "queue_p50_ms_after_large": 1e3 * float(np.percentile(queue[after_large], 50)),
                           "queue_p50_ms_after_small": 1e3 * float(np.percentile(queue[~after_large], 50)),
                           "slowest_after_large": int(after_large[np.argsort(lat)[::-1][:10]].sum())})
            o = rounds[-1]
            print(f"round {r}: {capacity:.0f}/s closed; open p99 {o['p99_ms']:.2f} ms, queue p99 {o['queue_p99_ms']:.2f}; "
                  f"of the 10 slowest {o['slowest_after_large']} right after a large item", flush=True)
            for cls in ("large", "small"):
                row = o["open"].get(cls, {})
                print(f"  {cls}: " + ", ".join(f"{k} {v['p50_us']:.0f}/{v['p90_us']:.0f}us x{v['calls_per_request']:.2f}"
                                             for k, v in row.items()), flush=True)
    write({**header(str(dev)), "large_bytes": LARGE, "load": args.load, "rounds": rounds}, args.out)


if __name__ == "__main__":
    main()
