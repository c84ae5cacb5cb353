"""What a call costs when a caller takes turns between more jobs than the warm cache keeps per
device: ``--jobs`` ordinary float32 arrays of sizes spread around ``--mib`` (each with its own
result array), called in turn with ``stream_map`` at each ``--host`` strategy, with the cache
holding ``--capacities`` engines per device. Rows give the median and p90 ms a call over
``--rounds`` turns (after two turns of warm-up), the engines built in the timed turns, and the
check that every result is right. Fresh random inputs each turn.

    python3 bench/warm_capacity.py --device cuda:0 --mib 1,16 --jobs 3 --capacities 2,3 --out FILE
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from _script import header, write

import ringflow as rf
from ringflow._pipeline import engine as engine_module
from ringflow._pipeline import warm


def _f(x, y):
    y[...] = x * 2 + 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="sim")
    ap.add_argument("--mib", default="1,16")
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--capacities", default="2,3")
    ap.add_argument("--host", default="stage,register")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = rf.device(args.device)
    built = [0]
    real_make = engine_module.make_engine

    def counted(*a, **k):
        built[0] += 1
        return real_make(*a, **k)

    from ringflow._pipeline import whole_array

    whole_array.make_engine = counted
    rng = np.random.default_rng(0)
    rows = []
    try:
        for mib in (float(m) for m in args.mib.split(",")):
            # sizes a little apart, so that each job has an engine of its own
            sizes = [int(mib * (1 << 20) * (1 + k / 8)) // 4 for k in range(args.jobs)]
            outs = [np.empty(n, np.float32) for n in sizes]
            for host in args.host.split(","):
                for capacity in (int(c) for c in args.capacities.split(",")):
                    warm.WARM.capacity = capacity
                    rf.drop_warm_pipelines()
                    times, ok = [], True
                    for turn in range(args.rounds + 2):
                        if turn == 2:
                            built[0] = 0
                        for n, out in zip(sizes, outs):
                            x = rng.random(n, dtype=np.float32)
                            t0 = time.perf_counter()
                            rf.stream_map(_f, x, out, device=dev, host=host)
                            if turn >= 2:
                                times.append(time.perf_counter() - t0)
                            ok = ok and bool(np.array_equal(out, x * 2 + 1))
                    times.sort()
                    row = {"mib": mib, "jobs": args.jobs, "host": host, "capacity": capacity,
                           "median_ms": times[len(times) // 2] * 1e3, "p90_ms": times[len(times) * 9 // 10] * 1e3,
                           "engines_built": built[0], "calls": len(times), "correct": ok}
                    rows.append(row)
                    print(row, flush=True)
    finally:
        whole_array.make_engine = real_make
        warm.WARM.capacity = warm.DEFAULT_CAPACITY
        rf.drop_warm_pipelines()
    write({**header(dev.name), "rows": rows}, args.out)
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
