"""The scheduler's own Python per request, on any machine: the ``requests`` workload's items
through one ``Pipeline`` on the simulated GPU (checker off), cProfile on the progress thread
and on the submitting thread, counting only ringflow's pipeline code (``_pipeline/``), the host
pool (``_device/host_pool.py``, the same on every device) and the standard library's threading
and futures they call, not the device backend. The figures are
profiled microseconds (cProfile slows Python calls several times), to compare one version of
the scheduler with another on one machine, not to predict a GPU's throughput.

    PYTHONPATH=src python3 bench/profile_scheduler.py [--items pooled|staged] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from ringflow._bench import kernels  # noqa: E402
from ringflow._pipeline import driver  # noqa: E402
from pinned_results_check import pooled_copies, request_items  # noqa: E402
from _script import header, write  # noqa: E402

MiB = 1 << 20
COUNTED = ("/ringflow/_pipeline/", "/ringflow/_device/host_pool.py", "threading.py", "concurrent/futures/")


def counted(filename: str) -> bool:
    return any(part in filename.replace(os.sep, "/") for part in COUNTED)


def table(prof: cProfile.Profile, requests: int, top: int) -> dict:
    rows = []
    for (fn, _line, func), (_cc, nc, tt, _ct, _callers) in pstats.Stats(prof).stats.items():
        if counted(fn):
            where = fn.replace(os.sep, "/").split("/ringflow/")[-1] if "/ringflow/" in fn else os.path.basename(fn)
            rows.append({"function": f"{where}:{func}", "calls_per_request": nc / requests,
                         "profiled_us_per_request": 1e6 * tt / requests})
    rows.sort(key=lambda r: -r["profiled_us_per_request"])
    return {"profiled_us_per_request": sum(r["profiled_us_per_request"] for r in rows),
            "calls_per_request": sum(r["calls_per_request"] for r in rows), "top": rows[:top]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", choices=("pooled", "staged"), default="pooled")
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device("sim", checked=False)
    items = request_items(args.count, 8 * MiB)
    if args.items == "pooled":
        items = pooled_copies(dev, items)
    progress, submit = cProfile.Profile(), cProfile.Profile()
    real = driver._run

    def run(d):  # the progress thread's body, profiled
        progress.enable()
        try:
            real(d)
        finally:
            progress.disable()

    driver._run = run
    try:
        with rf.Pipeline(kernels.scale_shift(), device=dev, chunk_bytes=8 * MiB) as pipe:
            submit.enable()
            for _ in range(args.passes):
                futures = [pipe.submit(it) for it in items]
                for fu in futures:
                    fu.result()
            submit.disable()
            steps = pipe.scheduler.steps
    finally:
        driver._run = real
    n = args.count * args.passes
    result = {**header(f"simulated h200-pcie5 on {platform.machine()} ({os.cpu_count()} CPUs)"),
              "python": platform.python_version(), "items": args.items, "requests": n,
              "steps_per_request": steps / n, "progress_thread": table(progress, n, args.top),
              "submitting_thread": table(submit, n, args.top)}
    for who in ("progress_thread", "submitting_thread"):
        t = result[who]
        print(f"{who}: {t['profiled_us_per_request']:.0f} profiled us and {t['calls_per_request']:.0f} calls a request")
        for r in t["top"]:
            print(f"  {r['profiled_us_per_request']:7.1f} us {r['calls_per_request']:6.1f} calls  {r['function']}")
    print(f"steps per request: {result['steps_per_request']:.2f}")
    write(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
