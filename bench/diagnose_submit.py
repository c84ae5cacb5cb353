"""Where the submitting thread's time goes in the ``requests`` stream: per request, the time in
``submit`` altogether, in the staging copy into pinned memory, and waiting for capacity, over
closed-loop passes of the workload's items (staged by ``submit``, the default).

    PYTHONPATH=src python3 bench/diagnose_submit.py --device cuda:0 --out submit.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from ringflow._bench import kernels  # noqa: E402
from _script import header, write  # noqa: E402
from pinned_results_check import MiB, request_items  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    items = request_items(args.count, 8 * MiB)
    spent = {"copy": 0.0, "capacity": 0.0}
    real_copy = dev.host_copy

    def timed_copy(dst, src):
        t0 = time.perf_counter()
        real_copy(dst, src)
        spent["copy"] += time.perf_counter() - t0

    dev.host_copy = timed_copy
    passes = []
    with rf.Pipeline(kernels.scale_shift(), device=dev, chunk_bytes=8 * MiB) as pipe:
        real_wait = pipe._driver.wait_for

        def timed_wait(*a, **k):
            t0 = time.perf_counter()
            try:
                return real_wait(*a, **k)
            finally:
                if threading_is_caller():
                    spent["capacity"] += time.perf_counter() - t0

        caller = __import__("threading").get_ident()

        def threading_is_caller():
            return __import__("threading").get_ident() == caller

        pipe._driver.wait_for = timed_wait
        for fu in [pipe.submit(it) for it in items[:30]]:
            fu.result()
        for _ in range(args.passes):
            spent.update(copy=0.0, capacity=0.0)
            in_submit = 0.0
            t0 = time.perf_counter()
            futs = []
            for it in items:
                s0 = time.perf_counter()
                futs.append(pipe.submit(it))
                in_submit += time.perf_counter() - s0
            submitted = time.perf_counter() - t0
            for fu in futs:
                fu.result()
            wall = time.perf_counter() - t0
            n = len(items)
            passes.append({"requests_per_s": n / wall, "submit_us": 1e6 * in_submit / n,
                           "copy_us": 1e6 * spent["copy"] / n, "capacity_wait_us": 1e6 * spent["capacity"] / n,
                           "rest_of_submit_us": 1e6 * (in_submit - spent["copy"] - spent["capacity"]) / n,
                           "all_submitted_after_s": submitted, "wall_s": wall,
                           "mean_request_bytes": sum(i.nbytes for i in items) / n})
            del futs
    res = {**header(str(dev)), "passes": passes,
           "median": {k: statistics.median(p[k] for p in passes) for k in passes[0]}}
    for k, v in res["median"].items():
        print(f"{k}: {v:.1f}")
    write(res, args.out)


if __name__ == "__main__":
    main()
