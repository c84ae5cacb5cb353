"""Whether the staging copy threads' polling pays on this host: for each polling time (the copy
threads' idle poll before they sleep), interleaved over rounds in one process,

* closed-loop staged requests (the ``requests`` workload's items through one ``Pipeline``, as
  ``bench/request_costs.py`` runs them): capacity and the submitting and progress threads' CPU
  time per request;
* the copy threads' counters over those passes (split copies, parts handed to a sleeping
  helper, the time callers polled for their helpers' parts after their own);
* the host's CPU time by kind over the passes (``/proc/stat``: user, system, idle, steal: time
  the hypervisor ran something else while a virtual CPU wanted to run);
* the copy alone: a 1 MiB and a 4 MiB staging copy into pinned memory, repeated, median µs.

    PYTHONPATH=src python3 bench/copy_spin_check.py --device cuda:0 --spins 200,50,0 --rounds 2 --out spin.json
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
from ringflow._device import native_copy  # noqa: E402
from _script import header, write  # noqa: E402
from pinned_results_check import MiB, request_items  # noqa: E402
from request_costs import run_variant  # noqa: E402

STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times() -> dict:
    """The host's CPU time by kind (seconds, all CPUs) from /proc/stat's first line."""
    with open("/proc/stat") as fh:
        vals = fh.readline().split()[1:1 + len(STAT_FIELDS)]
    tick = os.sysconf("SC_CLK_TCK")
    return {k: int(v) / tick for k, v in zip(STAT_FIELDS, vals)}


def copy_alone(dev, nbytes: int, reps: int) -> float:
    """Median µs of a staging copy of ``nbytes`` into a pool array (the copy ``submit`` makes)."""
    src = np.random.default_rng(1).random(nbytes // 8)
    dst = rf.host.empty(src.shape, src.dtype, device=dev)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dev.host_copy(dst, src)
        times.append(time.perf_counter() - t0)
        time.sleep(50e-6)  # a gap, as between requests: the helpers go idle and poll or sleep
    assert np.array_equal(dst, src)
    return 1e6 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--spins", default="200,50,0", help="polling times to compare, µs")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    items = request_items(args.count, 8 * MiB)
    spins = [float(s) for s in args.spins.split(",")]
    runs = []
    for r in range(args.rounds):
        for us in spins:
            native_copy.set_spin(us * 1e-6)
            c0, s0 = native_copy.counters(), cpu_times()
            v = run_variant(dev, items, args.passes, hz=0)
            c1, s1 = native_copy.counters(), cpu_times()
            dc = {k: c1[k] - c0[k] for k in c1}
            run = {"round": r, "spin_us": us, "capacity_per_s": v["capacity_per_s"], "passes_per_s": v["passes_per_s"],
                   "correct": v["correct"], "submit_cpu_us_per_request": v["submit_cpu_us_per_request"],
                   "progress_cpu_us_per_request": v["progress_cpu_us_per_request"], "copy_counters": dc,
                   "caller_wait_us_per_split": 1e-3 * dc["caller_wait_ns"] / max(1, dc["split_copies"]),
                   "host_cpu_s": {k: s1[k] - s0[k] for k in s1},
                   "copy_alone_us": {"1MiB": copy_alone(dev, MiB, 300), "4MiB": copy_alone(dev, 4 * MiB, 200)}}
            runs.append(run)
            print(f"round {r} spin {us:g} us: {run['capacity_per_s']:.0f}/s submit {run['submit_cpu_us_per_request']:.0f} "
                  f"progress {run['progress_cpu_us_per_request']:.0f} us cpu/request; caller waits "
                  f"{run['caller_wait_us_per_split']:.1f} us/split; steal {run['host_cpu_s']['steal']:.2f} s, "
                  f"idle {run['host_cpu_s']['idle']:.2f} s; copy alone {run['copy_alone_us']}", flush=True)
    write({**header(str(dev)), "spins_us": spins, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
