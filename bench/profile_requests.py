"""Where a request stream's progress thread spends its time: cProfile of the progress thread
over a closed-loop pass of the ``requests`` workload's
items, staged by ``submit`` and read in place from pool arrays.

    PYTHONPATH=src python3 bench/profile_requests.py --device cuda:0 --out profile-requests.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from ringflow._bench import kernels  # noqa: E402
from ringflow._pipeline import driver  # noqa: E402
from pinned_results_check import pooled_copies, request_items  # noqa: E402

MiB = 1 << 20


def profiled(dev, items, label: str, out: io.StringIO) -> None:
    prof = cProfile.Profile()
    real = driver._run

    def run(d):
        prof.enable()
        try:
            real(d)
        finally:
            prof.disable()

    driver._run = run
    try:
        f = kernels.scale_shift()
        with rf.Pipeline(f, device=dev, chunk_bytes=8 * MiB) as pipe:
            for fu in [pipe.submit(it) for it in items[:30]]:
                fu.result()
            t0 = time.perf_counter()
            futs = [pipe.submit(it) for it in items]
            for fu in futs:
                fu.result()
            rate = len(items) / (time.perf_counter() - t0)
            steps = pipe.scheduler.steps
    finally:
        driver._run = real
    out.write(f"== {label}: {rate:.0f} requests/s under cProfile, {steps} steps\n")
    for key in ("tottime", "cumulative"):  # one profiler at a time (Python 3.12): the progress thread's
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(35)
        out.write(f"-- progress thread, by {key}\n{s.getvalue()}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--count", type=int, default=600)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    items = request_items(args.count, 8 * MiB)
    pooled = pooled_copies(dev, items)
    out = io.StringIO()
    out.write(f"{dev} {rf.__version__} numpy {np.__version__} {time.strftime('%Y-%m-%d')}\n")
    profiled(dev, pooled, "items already pool arrays", out)
    profiled(dev, items, "plain arrays, staged by submit", out)
    text = out.getvalue()
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    print(text[:3000])


if __name__ == "__main__":
    main()
