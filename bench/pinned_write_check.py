"""How fast the CPU writes and reads each kind of host memory a pipeline's slot can be: a new
numpy array, the device's pinned allocation (``allocate_host``, the host rings of a pipeline on
threads), memory registered with the device (``register_host``, the shared block of worker
processes), and a pool array (``rf.host.empty``). One thread; a streaming copy in, the feed
workload's gather (a crop through a look-up table) in, the same on eight threads at once (an
eighth each), and a copy out; median of repeats.

    PYTHONPATH=src python3 bench/pinned_write_check.py --device cuda:0 --out pinned-write.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringflow as rf  # noqa: E402
from ringflow._bench.runner import environment  # noqa: E402
from _script import header, write  # noqa: E402

MiB = 1 << 20


def timed(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--mib", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = rf.device(args.device)
    n = args.mib * MiB
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, n, dtype=np.uint8)
    lut = rng.integers(0, 256, 256, dtype=np.uint8)
    allocated = dev.allocate_host(n)
    plain = np.zeros(n, np.uint8)
    spare = np.zeros(n, np.uint8)
    registered_array = np.zeros(n, np.uint8)
    registered = dev.register_host(registered_array)
    pool = rf.host.empty(n, np.uint8, device=dev)
    kinds = {"new numpy array (warm)": plain, "allocate_host": allocated.view(np.uint8, access="w"),
             "register_host": registered_array, "rf.host.empty": pool}
    res = {**header(str(dev)), "environment": environment(dev), "bytes": n, "kinds": {}}
    pool8 = concurrent.futures.ThreadPoolExecutor(8)
    for name, dst in kinds.items():
        dst[:] = 0
        step = n // 8

        def gather_8(dst=dst):
            list(pool8.map(lambda a: np.take(lut, src[a:a + step], out=dst[a:a + step]), range(0, n, step)))

        row = {"copy_in_GBps": n / timed(lambda: np.copyto(dst, src), args.repeats) / 1e9,
               "gather_in_8_threads_GBps": n / timed(gather_8, args.repeats) / 1e9,
               "gather_in_GBps": n / timed(lambda: np.take(lut, src, out=dst), args.repeats) / 1e9,
               "copy_out_GBps": n / timed(lambda: np.copyto(spare, dst), args.repeats) / 1e9}
        res["kinds"][name] = row
        print(f"{name:26s} " + "  ".join(f"{k} {v:6.2f}" for k, v in row.items()), flush=True)
    pool8.shutdown()
    registered.close()
    allocated.close()
    write(res, args.out)


if __name__ == "__main__":
    main()
