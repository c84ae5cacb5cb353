"""How fast a request's bytes are staged into pinned memory: pageable numpy arrays (each used
once, from a set larger than the caches) copied into one pinned pool array, by numpy on one
thread, by the native copy threads at 1-16 threads, and by torch's ``Tensor.copy_`` (its own
threads), median and spread of ``--reps`` copies per size.

    PYTHONPATH=src python3 bench/copy_rates.py --device cuda:0 --out copy-rates.json
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
from ringflow._device import native_copy, protocol  # noqa: E402
from _script import header, write  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--sizes", default="256K,1M,2M,4M,8M")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    sizes = [int(s[:-1]) * (MiB if s.endswith("M") else KiB) for s in args.sizes.split(",")]
    try:
        import torch
    except ImportError:
        torch = None
    ways = {"numpy": lambda d, s: np.copyto(d, s)}
    for t in (1, 2, 4, 8, 16):
        ways[f"native {t}"] = lambda d, s, t=t: native_copy.copy(d, s, t)
    ways["host_copy (as submit)"] = lambda d, s: dev.host_copy(d, s)
    if torch is not None:
        ways[f"torch copy_ ({torch.get_num_threads()} threads)"] = \
            lambda d, s: torch.from_numpy(d).copy_(torch.from_numpy(s))
    result = {**header(str(dev)), "native": native_copy.copier() is not None,
              "native_max_threads": protocol.NATIVE_MAX_THREADS, "sizes": {}}
    for n in sizes:
        dst = rf.host.empty((n,), np.uint8, device=dev)
        # sources enough to leave the caches between two uses of one
        srcs = [np.random.default_rng(i).integers(0, 255, n, dtype=np.uint8) for i in range(max(4, (512 * MiB) // n))]
        row = {}
        for name, way in ways.items():
            times = []
            for r in range(args.reps + 5):
                s = srcs[r % len(srcs)]
                t0 = time.perf_counter()
                way(dst, s)
                times.append(time.perf_counter() - t0)
            times = times[5:]
            med = statistics.median(times)
            row[name] = {"median_us": 1e6 * med, "p10_us": 1e6 * float(np.percentile(times, 10)),
                         "p90_us": 1e6 * float(np.percentile(times, 90)), "GBps": n / med / 1e9}
            assert np.array_equal(dst, srcs[(args.reps + 4) % len(srcs)])
        result["sizes"][str(n)] = row
        print(n, {k: (round(v["median_us"], 1), round(v["GBps"], 1)) for k, v in row.items()}, flush=True)
    write(result, args.out)


if __name__ == "__main__":
    main()
